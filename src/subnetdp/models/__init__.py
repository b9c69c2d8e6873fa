"""Models shipped with subnetdp (one folder each: a plain model file plus its adapter) and the
named recipes that pair a model with training defaults."""

from subnetdp.models.registry import RECIPES, Recipe, get_recipe, list_recipes

__all__ = ["RECIPES", "Recipe", "get_recipe", "list_recipes"]
