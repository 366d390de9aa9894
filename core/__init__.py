"""Pure functions the recipes are built from. The only state is torch's process group."""
