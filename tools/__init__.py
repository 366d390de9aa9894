"""The command line around the recipes: the registry, `python -m recipes ls|run|cp|diff|check|plot`,
the standalone inliner. Apart from core/, so a copied recipe carries none of it."""
