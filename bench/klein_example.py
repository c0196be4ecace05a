"""diffusers' FLUX.2 Klein example (`examples/dreambooth/train_dreambooth_lora_flux2_klein.py`, never committed) as
the benches run it: what both trainers share (`Setting`) and the example's command line (`peer_command`).
bench/klein_peer.py times it beside StableTune and bench/toy_quality.py scores what it learns; both import it from
here, so neither imports the other.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

NO_SNAPSHOTS = 1_000_000  # a save interval no run reaches
#: The layers of Qwen3's hidden states the pipeline stacks into the prompt embedding (Flux2KleinPipeline).
PIPELINE_TEXT_LAYERS = ("9", "18", "27")


@dataclass(frozen=True)
class Setting:
    """What both trainers share."""
    steps: int = 40
    rank: int = 8
    alpha: int | None = None  # None: the rank (scale 1)
    learning_rate: float = 1e-3
    batch: int = 4
    resolution: int = 64
    seed: int = 7
    precision: str = "no"  # accelerate's names: no, fp16, bf16
    gradient_checkpointing: bool = False

    @property
    def lora_alpha(self) -> int:
        return self.rank if self.alpha is None else self.alpha


def peer_command(script: Path, model: Path, peer_data: Path, run: Path, s: Setting, *,
                 snapshot_steps: int = NO_SNAPSHOTS, text_length: int | None = None) -> list[str]:
    """The example's arguments (after the probe): its defaults except what both trainers share. bench/toy_quality.py
    also asks for a snapshot every `snapshot_steps` and a `text_length` (max_sequence_length: the toy Klein's 32
    instead of the example's 512)."""
    command = [str(script), "--pretrained_model_name_or_path", str(model), "--dataset_name", str(peer_data),
               "--caption_column", "text", "--instance_prompt", "a shape", "--output_dir", str(run),
               "--cache_dir", str(run / "hf-cache"), "--max_train_steps", str(s.steps), "--rank", str(s.rank),
               "--lora_alpha", str(s.lora_alpha), "--learning_rate", str(s.learning_rate),
               "--train_batch_size", str(s.batch), "--resolution", str(s.resolution), "--seed", str(s.seed),
               "--mixed_precision", s.precision, "--checkpointing_steps", str(snapshot_steps),
               "--text_encoder_out_layers", *PIPELINE_TEXT_LAYERS, "--report_to", "tensorboard"]
    if text_length is not None:
        command += ["--max_sequence_length", str(text_length)]
    if s.gradient_checkpointing:
        command.append("--gradient_checkpointing")
    return command
