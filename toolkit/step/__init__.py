"""The step: TrainState, Step and its phases, the decorators, LossSum (public through :mod:`toolkit`)."""
