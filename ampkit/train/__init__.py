"""The training loop (Trainer), its config, checkpoints, metrics and evaluation."""
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .config import TrainConfig, load_config_file
from .trainer import RunDirError, RunDivergedError, Trainer, TrainingInterrupted, build_optimizer, build_scheduler

__all__ = [
    "Trainer", "TrainConfig", "TrainingInterrupted", "RunDirError", "RunDivergedError", "CheckpointError",
    "load_checkpoint", "save_checkpoint", "load_config_file", "build_optimizer", "build_scheduler",
]
