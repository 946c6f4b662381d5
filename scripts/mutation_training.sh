#!/usr/bin/env bash
# Mutation pass over SeCO's chunk selection and offload placement, the export callback, the
# tokens/s meter and the atomic writes (mutmut 3), with a scoped fast test selection.
#
#   python3 -m venv /path/to/venv && /path/to/venv/bin/pip install -c constraints.txt -e ".[test,fla]" mutmut
#   PATH=/path/to/venv/bin:$PATH scripts/mutation_training.sh [WORKDIR] [SECONDS]
#
# Runs in a scratch copy (WORKDIR, default /tmp/hybridzoo-mutation) so the checkout is untouched;
# stops after SECONDS (default 1500); MUTANTS="name-or-glob ..." runs only those. Then: cd WORKDIR && mutmut results (survivors), mutmut show NAME.
# Results of a run: benchmarks/results/2026-12-01-mutation-training.md.
set -euo pipefail
cd "$(dirname "$0")/.."
work=${1:-/tmp/hybridzoo-mutation}
seconds=${2:-1500}
rm -rf "$work" && mkdir -p "$work"
git ls-files | tar -cf - -T - | tar -xf - -C "$work"
cd "$work"
cat > setup.cfg <<'EOF'
[mutmut]
source_paths =
    hybridzoo/training/seco_engine.py
    hybridzoo/training/seco.py
    hybridzoo/training/callbacks.py
    hybridzoo/zoo/checkpoint.py
pytest_add_cli_args_test_selection =
    tests/training/test_seco_offload.py
    tests/training/test_spaco.py::test_spaco_mean_gradient_converges_to_the_exact_gradient[p=1/4]
    tests/training/test_spaco.py::test_draws_follow_the_seed_and_a_budget_of_at_least_k_chunks_is_exact_seco
    tests/training/test_export.py
    tests/zoo/test_checkpoint.py
    tests/training/test_seco.py::test_spaco_is_unbiased_over_every_selection_pattern
    tests/training/test_seco.py::test_spaco_draws_chunks_and_budget_of_all_chunks_is_exact
    tests/training/test_seco.py::test_offload_size_is_what_stage_one_keeps_and_too_much_is_refused
    tests/training/test_seco.py::test_kv_offload_gives_identical_gradients
pytest_add_cli_args =
    -p
    no:xdist
    -p
    no:cacheprovider
process_isolation = forkserver
timeout_multiplier = 4.0
timeout_constant = 30.0
EOF
# mutmut copies only source_paths into mutants/: the rest of the package is put there first
mkdir -p mutants && cp -r hybridzoo mutants/
rm mutants/hybridzoo/training/{seco_engine,seco,callbacks}.py mutants/hybridzoo/zoo/checkpoint.py
# torch is not fork-safe once used: forkserver; one intra-op thread per worker
export OMP_NUM_THREADS=1 TRITON_INTERPRET=1
S=hybridzoo.training.seco_engine
C=hybridzoo.training.callbacks
# MUTANTS (space-separated mutant names or globs, module paths as below) narrows the run
default=("$S.x__select__mutmut_*" "$S.xǁ_Layersǁ*" "$S.x__check_offload__mutmut_*" "$S.x_offload_bytes__mutmut_*"
         "$S.x_host_ram_bytes__mutmut_*" "$C.xǁExportCallbackǁ*" "$C.x_tokenizer_files__mutmut_*"
         "$C.xǁTokensPerSecondǁ*" "hybridzoo.zoo.checkpoint.x_write_atomically__mutmut_*")
read -r -a mutants <<< "${MUTANTS:-${default[*]}}"
timeout "$seconds" mutmut run --max-children 2 "${mutants[@]}" || true
mutmut results --all true 2>/dev/null || mutmut results
