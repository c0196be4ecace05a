"""The engine's validation images draw a prompt's seeds in one pipeline call (issue 35.3: the demo's summary reads
every kept colour, and more images must not cost a call each), each image as its seed draws it alone."""
from __future__ import annotations

import numpy as np
import torch
from PIL import Image


def test_validation_images_draw_a_prompts_seeds_in_one_call_each_as_drawn_alone(tiny_config, tmp_path, monkeypatch,
                                                                                one_thread):
    from stabletune_core.models.loading import load_model
    from stabletune_core.train.validation_images import make_validation_images

    config = tiny_config(validation_prompt="a red circle | a green square", num_validation_images=3,
                         validation_inference_steps=3)
    bundle = load_model(config)
    calls: list[int] = []
    make_pipeline = bundle.family.make_pipeline

    class Counted:  # the family's own pipeline, counting its calls
        def __init__(self, pipe):
            self.pipe = pipe

        def __call__(self, **kwargs):
            calls.append(kwargs.get("num_images_per_prompt", 1))
            return self.pipe(**kwargs)

        def __getattr__(self, name):
            return getattr(self.pipe, name)

    monkeypatch.setattr(bundle.family, "make_pipeline", lambda b, scheduler: Counted(make_pipeline(b, scheduler)))
    together = make_validation_images(bundle, config, tmp_path / "together", torch.device("cpu"))
    assert calls == [3, 3] and len(together) == 6
    calls.clear()
    alone = [make_validation_images(bundle, config, tmp_path / "alone", torch.device("cpu"), only=[i])[0]
             for i in range(6)]
    assert calls == [1] * 6
    assert [p.name for p in together] == [p.name for p in alone]
    for a, b in zip(together, alone):
        with Image.open(a) as x, Image.open(b) as y:
            assert np.abs(np.asarray(x, dtype=int) - np.asarray(y, dtype=int)).max() <= 1, a.name
    partial = make_validation_images(bundle, config, tmp_path / "partial", torch.device("cpu"), only=[1, 2, 3])
    assert calls[6:] == [2, 1] and [p.name for p in partial] == [p.name for p in together[1:4]]
