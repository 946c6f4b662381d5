"""Thin adapters to fla / mamba_ssm / torch SDPA, imported only when asked for."""
