"""The step: TrainState, Step, its phases and decorators, LossSum (public via :mod:`toolkit`)."""
