"""Packaged recipes (LightningCLI YAML). ``hybridzoo.zoo.recipes.recipe_names()`` lists them."""
