"""diffusers' examples for the transformer families (`examples/dreambooth/train_dreambooth_lora_flux2_klein.py` and
`train_dreambooth_lora_z_image.py`, never committed) as the benches run them: what both trainers share (`Setting`),
what differs per family (`PeerFamily`) and the example's command line (`peer_command`). bench/transformer_peer.py
times an example beside StableTune and bench/toy_quality.py scores what it learns; both import it from here, so neither
imports the other.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

NO_SNAPSHOTS = 1_000_000  # a save interval no run reaches
#: The layers of Qwen3's hidden states the pipeline stacks into the prompt embedding (Flux2KleinPipeline).
PIPELINE_TEXT_LAYERS = ("9", "18", "27")


@dataclass(frozen=True)
class PeerFamily:
    """What differs between the transformer families the benches compare: StableTune's family name, the example's
    script, the StableTune LoRA preset that spells the example's default targets, the example's extra arguments,
    and the tiny real-layout model both trainers run on by default."""
    name: str
    example_script: str
    targets_preset: str
    example_arguments: tuple[str, ...]
    tiny_builder: str  # "module:function" building a diffusers folder (out_dir, seed)

    def targets(self) -> list[str]:
        from stabletune_core.models import get_family

        return list(get_family(self.name).lora_presets[self.targets_preset])

    def build_tiny(self, out: Path) -> Path:
        import importlib

        module, function = self.tiny_builder.split(":")
        return getattr(importlib.import_module(module), function)(out, seed=0)


FAMILIES = {
    # The example's --text_encoder_out_layers default (10 20 30) is not what Flux2KleinPipeline reads (9 18 27).
    "flux2_klein": PeerFamily("flux2_klein", "train_dreambooth_lora_flux2_klein.py", "diffusers_default",
                              ("--text_encoder_out_layers", *PIPELINE_TEXT_LAYERS),
                              "stabletune_core.models.flux2_klein.tiny:build_tiny_klein"),
    # The Z-Image example's default targets (to_k, to_q, to_v, to_out.0) are every attention's: StableTune's
    # "attention" preset; its text path reads the hidden states ZImagePipeline reads, so nothing is added.
    "z_image": PeerFamily("z_image", "train_dreambooth_lora_z_image.py", "attention", (),
                          "stabletune_core.models.z_image.tiny:build_tiny_z_image"),
}
KLEIN = FAMILIES["flux2_klein"]


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
                 snapshot_steps: int = NO_SNAPSHOTS, text_length: int | None = None,
                 family: PeerFamily = KLEIN) -> list[str]:
    """The example's arguments (after the probe): its defaults except what both trainers share. bench/toy_quality.py
    also asks for a snapshot every `snapshot_steps` and a `text_length` (max_sequence_length: the toy Klein's 32
    instead of the example's 512)."""
    command = [str(script), "--pretrained_model_name_or_path", str(model), "--dataset_name", str(peer_data),
               "--caption_column", "text", "--instance_prompt", "a shape", "--output_dir", str(run),
               "--cache_dir", str(run / "hf-cache"), "--max_train_steps", str(s.steps), "--rank", str(s.rank),
               "--lora_alpha", str(s.lora_alpha), "--learning_rate", str(s.learning_rate),
               "--train_batch_size", str(s.batch), "--resolution", str(s.resolution), "--seed", str(s.seed),
               "--mixed_precision", s.precision, "--checkpointing_steps", str(snapshot_steps),
               *family.example_arguments, "--report_to", "tensorboard"]
    if text_length is not None:
        command += ["--max_sequence_length", str(text_length)]
    if s.gradient_checkpointing:
        command.append("--gradient_checkpointing")
    return command
