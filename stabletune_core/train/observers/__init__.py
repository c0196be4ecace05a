"""Observers: they measure and record, never decide (base.py says when each hook runs). Validation loss and the
evaluator it measures with (validation_loss.py), LoRA spectra and activation statistics (diagnostics.py),
TensorBoard (tensorboard.py), the judges of validation images (judges.py names them, sample_judge.py) and the
judge-free perceptual drift of any run's validation images (perceptual_drift.py).

Light on purpose: the config imports judges.py from here and must not import torch."""
