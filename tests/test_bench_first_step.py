"""bench/first_step.py (issue 21 item 5): its StableTune rows are what StableTune's own parser reads. The same-work
row encodes every batch with the VAE as the example does, although the demo preset caches latents; the cached row
differs from it in that alone."""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_bench():
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location("first_step", ROOT / "bench" / "first_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parsed(command: list[str]):
    from stabletune_core.config.flags import add_config_arguments, config_from_args

    assert command[:3] == ["-m", "stabletune_core", "train"]
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    return config_from_args(parser.parse_args(command[3:]))


def test_same_work_rows_encode_like_the_example_and_the_cached_row_differs_only_in_caching(tmp_path):
    bench = load_bench()
    model, data = tmp_path / "model", tmp_path / "data"

    def config(overrides: list[str]):
        return parsed(bench.stabletune(model, data, tmp_path / "run", 30, 10, overrides))

    shipped, same, cached = config([]), config(bench.SAME_WORK), config(bench.SAME_WORK_CACHED)
    assert shipped.cache_latents and shipped.train_text_encoder  # the demo preset as a user runs it
    assert not same.cache_latents and not same.train_text_encoder and same.validation_prompt == ""
    assert cached.cache_latents
    differ = {name for name in type(same).model_fields if getattr(same, name) != getattr(cached, name)}
    assert differ == {"cache_latents"}
