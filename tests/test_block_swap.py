"""Issue 36 item 2: block swap keeps N transformer blocks in CPU memory and brings each in only while it runs, on
FLUX.2 Klein and on Z-Image (issue 39: its refiners and main layers, models/z_image/family.py swappable_blocks).

On the CPU both sides of a swap are the same memory, so what these tests prove is the bookkeeping: a run with swap
trains bitwise what a run without it trains, each swapped block is brought in exactly when it runs (forward, and
again for the backward pass's recomputation) and sent back right after, and a block that is out cannot be used
(its tensors are empty placeholders: a use would fail, not compute quietly).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from flux2_tools import tiny_klein_paths
from stabletune_core.config import ConfigError, build_config
from stabletune_core.models.block_swap import BlockSwap
from stabletune_core.runs.reader import RunReader
from test_z_image import folders  # noqa: F401 (the module-scoped tiny Z-Image)

STEPS = 4


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return tiny_klein_paths(tmp_path_factory)


@pytest.fixture(scope="module")
def z_image_folder(folders):  # noqa: F811 (test_z_image's module fixture building the tiny Z-Image)
    return folders["base"]


def klein_run(paths, data: Path, out: Path, on_setup=None, **overrides):
    """A 4-step Klein run in this process with gradient checkpointing; returns the session and its metrics."""
    return family_run("flux2_klein", paths["folder"], data, out, on_setup, **overrides)


def family_run(family: str, model: Path, data: Path, out: Path, on_setup=None, **overrides):
    """A 4-step run of `family` from the tiny folder `model` in this process with gradient checkpointing; returns the
    session and its metrics."""
    from stabletune_core.train.loop import setup, train

    values = dict(model_family=family, pretrained_model_name_or_path=str(model),
                  train_data_dir=str(data), output_dir=str(out), resolution=64, bucket_step=8, min_bucket_reso=32,
                  max_bucket_reso=128, train_batch_size=2, learning_rate=1e-3, max_train_steps=STEPS, lora_rank=4,
                  save_steps=1000, seed=3, save_precision="fp32", validation_split=0, gradient_checkpointing=True)
    config = build_config({**values, **overrides})
    session = setup(config)
    if on_setup:
        on_setup(session)
    train(config, session=session)
    return session, RunReader(out).metrics()


def per_step(metrics: list[dict]) -> list[tuple[float, float]]:
    return [(m["loss"], m["grad_norm"]) for m in metrics]


def watch_uses(uses: list[tuple[int, bool]]):
    """An on_setup that records (block, resident when its forward ran) for every forward of a swapped block."""
    def watch(session):
        swap: BlockSwap = session.bundle.extra["block_swap"]
        assert swap.resident == []  # set up: every swapped block starts out
        for block in swap.blocks:
            forward = type(block.module).forward

            def counted(*args, _block=block, _forward=forward, **kwargs):
                uses.append((_block.index, _block.resident))
                return _forward(_block.module, *args, **kwargs)
            block.module.forward = counted
    return watch


def assert_same_training_and_blocks_back_out(plain_run: Path, swap_run: Path, plain: list[dict],
                                             swapped: list[dict], swap: BlockSwap, count: int) -> None:
    """The swapped run trained bitwise what the plain one did, and left every swapped block out (empty)."""
    assert per_step(swapped) == per_step(plain)  # bitwise: == on the floats
    lora_plain = load_file(plain_run / "output" / "lora.safetensors")
    lora_swap = load_file(swap_run / "output" / "lora.safetensors")
    assert lora_plain.keys() == lora_swap.keys()
    assert all(torch.equal(lora_plain[k], lora_swap[k]) for k in lora_plain)
    assert swap.sent_back == swap.brought_in  # each went back right after it ran
    assert swap.resident == []
    for block in swap.blocks:  # out means empty: a use would fail instead of computing with stale weights
        assert all(f.current().numel() == 0 for f in block.frozen)
        assert all(p.numel() > 0 for p in block.module.parameters() if p.requires_grad)  # the LoRA stays put
    event = [e for e in RunReader(swap_run).events() if e.get("kind") == "placement" and "blocks_swapped" in e]
    assert event and event[0]["blocks_swapped"] == count


def test_swapped_run_is_bitwise_the_plain_run_and_each_block_moves_only_when_it_runs(paths, shapes_dataset,
                                                                                    tmp_path, one_thread):
    _, plain = klein_run(paths, shapes_dataset, tmp_path / "plain")
    uses: list[tuple[int, bool]] = []  # (block, resident when its forward ran)
    session, swapped = klein_run(paths, shapes_dataset, tmp_path / "swap", on_setup=watch_uses(uses),
                                 blocks_to_swap=3)
    swap: BlockSwap = session.bundle.extra["block_swap"]
    assert_same_training_and_blocks_back_out(tmp_path / "plain", tmp_path / "swap", plain, swapped, swap, 3)

    # the tiny Klein has 2 double + 2 single blocks; the last 3 are swapped (blocks 1, 2 and 3)
    assert [b.index for b in swap.blocks] == [1, 2, 3]
    assert uses and all(resident for _, resident in uses)  # never run while out
    # per step: the forward runs each block once and the backward recomputes it once, in reverse order
    assert [i for i, _ in uses] == [1, 2, 3, 3, 2, 1] * STEPS
    assert swap.brought_in == {1: 2 * STEPS, 2: 2 * STEPS, 3: 2 * STEPS}


def test_z_image_swapped_run_is_bitwise_the_plain_run_and_each_block_moves_only_when_it_runs(
        z_image_folder, shapes_dataset, tmp_path, one_thread):
    """The tiny Z-Image's 6 blocks (noise refiners 0-1, context refiners 2-3, main layers 4-5), all swapped."""
    _, plain = family_run("z_image", z_image_folder, shapes_dataset, tmp_path / "plain")
    uses: list[tuple[int, bool]] = []
    session, swapped = family_run("z_image", z_image_folder, shapes_dataset, tmp_path / "swap",
                                  on_setup=watch_uses(uses), blocks_to_swap=6)
    swap: BlockSwap = session.bundle.extra["block_swap"]
    assert_same_training_and_blocks_back_out(tmp_path / "plain", tmp_path / "swap", plain, swapped, swap, 6)

    denoiser = session.bundle.denoiser
    assert [b.module for b in swap.blocks] == [*denoiser.noise_refiner, *denoiser.context_refiner, *denoiser.layers]
    assert uses and all(resident for _, resident in uses)  # never run while out
    # the backward pass recomputes them in exactly the reverse order (the context refiners before the noise refiners)
    assert [i for i, _ in uses] == [0, 1, 2, 3, 4, 5, 5, 4, 3, 2, 1, 0] * STEPS
    assert swap.brought_in == {i: 2 * STEPS for i in range(6)}


def test_z_image_quantised_base_with_swap_in_bf16_is_bitwise_the_quantised_base_alone(z_image_folder, shapes_dataset,
                                                                                       tmp_path, one_thread):
    """nf4 codes and fp32 scales stay as stored in the swapped blocks, the rest in the run's bf16; 3 swapped: the
    last context refiner and both main layers (the swap crosses the refiners' boundary)."""
    quantised = dict(base_storage="nf4", mixed_precision="bf16")
    _, alone = family_run("z_image", z_image_folder, shapes_dataset, tmp_path / "alone", **quantised)
    session, swapped = family_run("z_image", z_image_folder, shapes_dataset, tmp_path / "swap", blocks_to_swap=3,
                                  **quantised)
    swap: BlockSwap = session.bundle.extra["block_swap"]
    assert_same_training_and_blocks_back_out(tmp_path / "alone", tmp_path / "swap", alone, swapped, swap, 3)
    assert [b.module for b in swap.blocks] == [session.bundle.denoiser.context_refiner[1],
                                               *session.bundle.denoiser.layers]
    homes = {f.name: f.home.dtype for b in swap.blocks for f in b.frozen}
    assert homes["codes"] == torch.uint8 and homes["scale"] == torch.float32
    assert torch.bfloat16 in {f.home.dtype for b in swap.blocks for f in b.frozen if f.follows_dtype}


def test_a_block_that_is_out_cannot_compute():
    block = torch.nn.Sequential(torch.nn.Linear(4, 4)).requires_grad_(False)  # frozen: what swap moves
    swap = BlockSwap.attach([block], 1, "cpu")
    swap.detach()  # hooks removed, weights back: it computes
    assert block(torch.ones(1, 4)).shape == (1, 4)
    swap = BlockSwap.attach([block], 1, "cpu")
    for handle in swap._handles:
        handle.remove()
    with pytest.raises(RuntimeError):
        block(torch.ones(1, 4))


@pytest.mark.parametrize("overrides, words", [
    (dict(model_family="sd1", blocks_to_swap=2, gradient_checkpointing=True), "block swap"),
    (dict(model_family="flux2_klein", blocks_to_swap=2), "needs gradient_checkpointing"),
])
def test_swap_where_it_cannot_work_is_one_sentence(overrides, words, tmp_path):
    with pytest.raises((ConfigError, ValueError)) as caught:
        build_config({"pretrained_model_name_or_path": "x", "train_data_dir": "y", "output_dir": str(tmp_path),
                      **overrides})
    text = str(caught.value)
    assert words in text and "blocks_to_swap" in text and "\n" not in text.strip()


#: (family, the fixture of its tiny folder, its swappable blocks, its name in sentences)
TINY = {"flux2_klein": ("paths", 4, "FLUX.2 Klein"), "z_image": ("z_image_folder", 6, "Z-Image")}


def tiny_folder(request, family: str) -> Path:
    found = request.getfixturevalue(TINY[family][0])
    return found["folder"] if family == "flux2_klein" else found


@pytest.mark.parametrize("family", TINY)
def test_more_blocks_than_the_model_has_fails_in_one_sentence(family, request, shapes_dataset, tmp_path,
                                                              one_thread):
    from stabletune_core.train.loop import setup

    _, blocks, name = TINY[family]
    config = build_config(dict(model_family=family, pretrained_model_name_or_path=str(tiny_folder(request, family)),
                               train_data_dir=str(shapes_dataset), output_dir=str(tmp_path / "run"), resolution=64,
                               bucket_step=8, min_bucket_reso=32, max_bucket_reso=128, max_train_steps=1,
                               validation_split=0, gradient_checkpointing=True, blocks_to_swap=9))
    with pytest.raises(ConfigError) as caught:
        setup(config)
    assert caught.value.problems == [f"blocks_to_swap 9 is more than the {blocks} blocks of this {name} transformer; "
                                     f"use at most {blocks}."]


@pytest.mark.parametrize("family", TINY)
def test_out_of_memory_at_micro_batch_1_swaps_more_blocks_and_changes_no_number(family, request, shapes_dataset,
                                                                                 tmp_path, one_thread):
    """The out-of-memory chain: micro-batch halves (2 -> 1), then a quarter of the blocks more (at least one) are
    swapped (0 -> 1 -> 2), each time the same step retried with the same random draws; never a change of the base's
    storage."""
    folder, blocks, _ = tiny_folder(request, family), *TINY[family][1:]
    _, plain = family_run(family, folder, shapes_dataset, tmp_path / "plain")
    from stabletune_core.train import faults

    faults.install("oom@2,oom@2,oom@3")
    try:
        session, survived = family_run(family, folder, shapes_dataset, tmp_path / "oom")
    finally:
        faults.install(None)
    ooms = [e for e in RunReader(tmp_path / "oom").events() if e.get("kind") == "oom"]
    assert [(e["step"], e.get("new_micro_batch"), e.get("new_blocks_swapped")) for e in ooms] == [
        (2, 1, None), (2, None, 1), (3, None, 2)]
    assert "block swap" in ooms[1]["message"]
    swap: BlockSwap = session.bundle.extra["block_swap"]
    last, before = blocks - 1, blocks - 2
    assert [b.index for b in swap.blocks] == [before, last] and swap.resident == []
    assert swap.brought_in[before] >= 2 and swap.brought_in[last] > swap.brought_in[before]  # last: since step 2
    assert RunReader(tmp_path / "oom").status()["state"] == "finished"
    assert [m["micro_batch_size"] for m in survived] == [2, 1, 1, 1]
    # a micro-batch of 1 sums the batch in two halves (float order); swapping itself changes no number
    torch.testing.assert_close(torch.tensor(per_step(survived)), torch.tensor(per_step(plain)), rtol=1e-5, atol=0)


def test_memory_guard_swaps_a_quarter_more_blocks_then_stops():
    from types import SimpleNamespace

    from stabletune_core.train.guards import MemGuard

    def view(**values):
        return SimpleNamespace(**{**dict(step=3, micro_batch_size=1, blocks_swapped=0, blocks_swappable=25), **values})

    guard = MemGuard(retries=2)
    (verdict,) = guard.on_out_of_memory(view(), "oom", tries=0)
    assert type(verdict).__name__ == "SwapMoreBlocks" and (verdict.old, verdict.new, verdict.step) == (0, 6, 4)
    (verdict,) = guard.on_out_of_memory(view(blocks_swapped=24), "oom", tries=5)
    assert (verdict.old, verdict.new) == (24, 25)
    (stop,) = guard.on_out_of_memory(view(blocks_swapped=25), "oom", tries=6)
    assert type(stop).__name__ == "StopOutOfMemory" and "base_storage int8 or nf4" in stop.message
    (shrink,) = guard.on_out_of_memory(view(micro_batch_size=4), "oom", tries=0)  # halving comes first
    assert type(shrink).__name__ == "ShrinkMicroBatch"
    assert guard.state_dict() == {"halvings": 1, "swaps": 2}
