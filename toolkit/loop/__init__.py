"""The loop driver run(), its data position and evaluate (public through :mod:`toolkit`)."""
