"""bench/first_step.py (issue 21 item 5): its StableTune rows are what StableTune's own parser reads. The same-work
row encodes every batch with the VAE as the example does, although the demo preset caches latents; the cached row
differs from it in that alone."""
from __future__ import annotations

from bench_scripts import load_bench, parsed_by_stabletune


def test_same_work_rows_encode_like_the_example_and_the_cached_row_differs_only_in_caching(tmp_path):
    bench = load_bench("first_step")
    model, data = tmp_path / "model", tmp_path / "data"

    def config(overrides: list[str]):
        return parsed_by_stabletune(bench.stabletune(model, data, tmp_path / "run", 30, 10, overrides))

    shipped, same, cached = config([]), config(bench.SAME_WORK), config(bench.SAME_WORK_CACHED)
    assert shipped.cache_latents and shipped.train_text_encoder  # the demo preset as a user runs it
    assert not same.cache_latents and not same.train_text_encoder and same.validation_prompt == ""
    assert cached.cache_latents
    differ = {name for name in type(same).model_fields if getattr(same, name) != getattr(cached, name)}
    assert differ == {"cache_latents"}
