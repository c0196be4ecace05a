"""Shared fixtures: a tiny real-architecture SD1 model and a drawn dataset, built once per session, offline."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DIFFUSERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from stabletune_core.models.sd.tiny import build_tiny_sd1

    return build_tiny_sd1(tmp_path_factory.mktemp("tiny-sd1") / "model", seed=0)


@pytest.fixture(scope="session")
def shapes_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from stabletune_core.demo import draw_demo_dataset

    return draw_demo_dataset(tmp_path_factory.mktemp("shapes") / "data", count=8, size=64, seed=0)


@pytest.fixture(scope="session")
def small_config(shapes_dataset: Path):
    """A factory of small, fast configs for any tiny model: small_config(model, output_dir, **overrides)."""
    from stabletune_core.config import build_config

    def make(model: Path, output_dir: Path, /, **overrides):
        values = dict(pretrained_model_name_or_path=str(model), train_data_dir=str(shapes_dataset),
                      output_dir=str(output_dir), resolution=64, bucket_step=8, min_bucket_reso=32,
                      max_bucket_reso=128, train_batch_size=4, learning_rate=1e-3, max_train_steps=10,
                      lora_rank=4, lora_alpha=8, save_steps=1000, seed=3, save_precision="fp32",
                      validation_split=0.0)  # all 8 images train (the automatic split has its own test)
        values.update(overrides)
        return build_config(values)

    return make


@pytest.fixture
def tiny_config(tiny_model: Path, small_config, tmp_path: Path):
    """A factory of small, fast configs on the tiny SD1 model; keyword arguments override."""
    return lambda **overrides: small_config(tiny_model, tmp_path / "run", **overrides)


@pytest.fixture
def one_thread():
    """The tiny model is dispatch-bound: on 2 shared cores, 2 intra-op threads are many times slower than 1."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def toy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private STABLETUNE_CACHE, so tests never touch the user's cache."""
    return tmp_path_factory.mktemp("stabletune-cache")


@pytest.fixture(scope="session")
def toy_base(toy_cache: Path) -> Path:
    """The shipped pretrained toy base model (stabletune_core/toy), as a diffusers folder."""
    from stabletune_core.toy import WEIGHTS, materialize

    return materialize(WEIGHTS, toy_cache / "toy-base")
