"""Every kind of line the engine writes to RUN/events.jsonl, named for what happened; engine and UI both import
these names, never spell them. `RunWriter.event` refuses a kind that is not here (a typo is a bug, not a new kind).
Torch-free: the UI reads it."""
from __future__ import annotations

# ---- the run's life ---------------------------------------------------------------------------------------------
FINISHED = "finished"  # the run reached its last step (status.json: finished)
STOPPED = "stopped"  # the run ended on a stop (UI, early stopping, Ctrl-C) after a last checkpoint, or before a step
FAILED = "failed"  # the run ended with a sentence saying why (written by runs.writer.record_outcome)
STOP_REQUESTED = "stop"  # a stop was asked for (UI, Ctrl-C / SIGTERM); the run saves and ends after this step
PAUSED = "pause"  # the UI paused the run between two steps
UNPAUSED = "unpaused"  # the UI let a paused run continue (the same process)
RESUMED_FROM_CHECKPOINT = "resumed_from_checkpoint"  # a new process continued the run from a checkpoint
NOTHING_TO_RESUME = "nothing_to_resume"  # resume was asked for, no checkpoint was found: the run starts at step 0
PREVIOUS_DIED = "previous_died"  # the process before this one died without ending the run
CONTROL_IGNORED = "control_ignored"  # a control.json that is not a command was removed unread
# ---- set-up ---------------------------------------------------------------------------------------------------------
MODEL = "model"  # which model (family, variant) was loaded, and what to know about it (a distilled base, ...)
CONFIG = "config"  # a note about the settings (valid, probably not what was meant), or a value the engine resolved
SEED = "seed"  # seed -1: the random seed the run drew
PRECISION = "precision"  # mixed precision: asked for on a CPU, or the fp16 fallback switched
PROCESSES = "processes"  # several processes share the run
THREADS = "threads"  # a CPU run's torch thread count, and why (train/threads.py)
ATTENTION = "attention"  # which attention kernel runs
DATA = "data"  # a note about the dataset (folder names, masks, augmentation turned off by caching)
DATA_SKIPPED = "data_skipped"  # images the scan could not use
VALIDATION_SPLIT = "validation_split"  # images held out of training
REG_IMAGES = "reg_images"  # prior preservation with class images
LATENT_CACHE = "latent_cache"  # latents encoded or reused
PLACEMENT = "placement"  # modules left on the CPU after caching; quantised base storage; block swap
MEMORY_PLAN = "memory_plan"  # vram_gb: the settings the memory plan chose, with its estimate
PERCEPTUAL = "perceptual"  # the LPIPS term is on (and whether its backbone is real)
PREFLIGHT = "preflight"  # the preflight's measurements
# ---- the guards' decisions ------------------------------------------------------------------------------------------
NONFINITE = "nonfinite"  # a step skipped for a non-finite loss or gradient
FP16_OVERFLOW = "fp16_overflow"  # a step skipped because fp16 gradients overflowed
ROLLBACK = "rollback"  # weights and optimizer rolled back after repeated non-finite steps
OOM = "oom"  # out of memory: the step retried with a smaller micro-batch
OOM_STOP = "oom_stop"  # out of memory even at the smallest micro-batch
LR_PLATEAU = "lr_plateau"  # the plateau schedule lowered the learning rate
EARLY_STOPPING_TRIGGER = "early_stopping_trigger"  # validation loss clearly above its best
EARLY_STOP = "early_stop"  # early stopping ended the run
# ---- checkpoints, files and measurements ----------------------------------------------------------------------------
CHECKPOINT = "checkpoint"  # a checkpoint was saved
CHECKPOINT_FAILED = "checkpoint_failed"  # a checkpoint could not be written (the run goes on)
CHECKPOINT_BAD = "checkpoint_bad"  # a checkpoint that cannot be trusted was skipped or a half-written one removed
EXPORTED = "exported"  # a LoRA file was written
SAMPLES = "samples"  # validation images were made
SAMPLE_SCORE = "sample_score"  # the sample judge scored them
LEARNING = "learning"  # the sample judge's summary of the run
VALIDATION = "validation"  # how the validation loss is measured (at its first measurement)
COLLAPSE = "collapse"  # the LoRA's rank collapsed
COLLAPSE_RECOVERED = "collapse_recovered"  # it recovered

#: Every kind, for checking.
EVENT_KINDS: frozenset[str] = frozenset(value for name, value in dict(globals()).items()
                                        if name.isupper() and isinstance(value, str))
