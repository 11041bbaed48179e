"""The `metrics` section of the config schema: where each step's record goes (`metrics.trackers`)."""

from __future__ import annotations

from dataclasses import dataclass, field

TRACKERS = ("tensorboard", "jsonl", "wandb", "mlflow")
WANDB_MODES = ("online", "offline")


@dataclass(frozen=True)
class WandbConfig:
    """A Weights & Biases run: `project`, `entity` (None: the account's default), `name` (None: the
    run's name), `tags`, `mode` (None: wandb's own, e.g. `WANDB_MODE`), how long to wait for the server
    at start (`init_timeout_s`)."""

    project: str = "podtrain"
    entity: str | None = None
    name: str | None = None
    tags: list[str] = field(default_factory=list)
    mode: str | None = None
    init_timeout_s: float = 60.0


@dataclass(frozen=True)
class MlflowConfig:
    """An MLflow run: `tracking_uri` (None: `MLFLOW_TRACKING_URI` or MLflow's default), `experiment`,
    `run_name` (None: the run's name)."""

    tracking_uri: str | None = None
    experiment: str = "podtrain"
    run_name: str | None = None


@dataclass(frozen=True)
class MetricsConfig:
    """Where process 0 sends each step's record: `trackers`, any of "tensorboard" (`<run dir>/tensorboard`),
    "jsonl" (`<run dir>/metrics.jsonl`), "wandb" and "mlflow" (`pip install 'podtrain[trackers]'`)."""

    trackers: list[str] = field(default_factory=lambda: ["tensorboard", "jsonl"])
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)

    def validate(self, prefix: str = "metrics") -> None:
        """Raises ValueError naming the key for an unknown or repeated tracker, or one not installed."""
        import importlib.util

        for name in self.trackers:
            if name not in TRACKERS:
                raise ValueError(f"{prefix}.trackers: expected some of {list(TRACKERS)}, found {name!r}")
            if name in ("wandb", "mlflow") and importlib.util.find_spec(name) is None:
                raise ValueError(f"{prefix}.trackers: {name!r} needs the {name} package, which is not installed: "
                                 "pip install 'podtrain[trackers]'")
        if len(set(self.trackers)) != len(self.trackers):
            raise ValueError(f"{prefix}.trackers: each tracker once, found {list(self.trackers)}")
        if self.wandb.mode is not None and self.wandb.mode not in WANDB_MODES:
            raise ValueError(f"{prefix}.wandb.mode: expected one of {list(WANDB_MODES)} or null, "
                             f"found {self.wandb.mode!r}")
        if self.wandb.init_timeout_s <= 0:
            raise ValueError(f"{prefix}.wandb.init_timeout_s: expected seconds > 0, found {self.wandb.init_timeout_s}")
