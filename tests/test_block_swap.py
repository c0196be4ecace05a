"""Issue 36 item 2: block swap keeps N transformer blocks in CPU memory and brings each in only while it runs.

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

STEPS = 4


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    return tiny_klein_paths(tmp_path_factory)


def klein_run(paths, data: Path, out: Path, on_setup=None, **overrides):
    """A 4-step Klein run in this process with gradient checkpointing; returns the session and its metrics."""
    from stabletune_core.train.loop import setup, train

    values = dict(model_family="flux2_klein", pretrained_model_name_or_path=str(paths["folder"]),
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


def test_swapped_run_is_bitwise_the_plain_run_and_each_block_moves_only_when_it_runs(paths, shapes_dataset,
                                                                                    tmp_path, one_thread):
    _, plain = klein_run(paths, shapes_dataset, tmp_path / "plain")
    uses: list[tuple[int, bool]] = []  # (block, resident when its forward ran)

    def watch(session):
        swap: BlockSwap = session.bundle.extra["block_swap"]
        assert swap.resident == []  # set up: every swapped block starts out
        for block in swap.blocks:
            forward = type(block.module).forward

            def counted(*args, _block=block, _forward=forward, **kwargs):
                uses.append((_block.index, _block.resident))
                return _forward(_block.module, *args, **kwargs)
            block.module.forward = counted

    session, swapped = klein_run(paths, shapes_dataset, tmp_path / "swap", on_setup=watch, blocks_to_swap=3)
    swap: BlockSwap = session.bundle.extra["block_swap"]

    assert per_step(swapped) == per_step(plain)  # bitwise: == on the floats
    lora_plain = load_file(tmp_path / "plain" / "output" / "lora.safetensors")
    lora_swap = load_file(tmp_path / "swap" / "output" / "lora.safetensors")
    assert lora_plain.keys() == lora_swap.keys()
    assert all(torch.equal(lora_plain[k], lora_swap[k]) for k in lora_plain)

    # the tiny Klein has 2 double + 2 single blocks; the last 3 are swapped (blocks 1, 2 and 3)
    assert [b.index for b in swap.blocks] == [1, 2, 3]
    assert uses and all(resident for _, resident in uses)  # never run while out
    # per step: the forward runs each block once and the backward recomputes it once, in reverse order
    assert [i for i, _ in uses] == [1, 2, 3, 3, 2, 1] * STEPS
    assert swap.brought_in == {1: 2 * STEPS, 2: 2 * STEPS, 3: 2 * STEPS}
    assert swap.sent_back == swap.brought_in  # and each went back right after it ran
    assert swap.resident == []
    for block in swap.blocks:  # out means empty: a use would fail instead of computing with stale weights
        assert all(f.current().numel() == 0 for f in block.frozen)
        assert all(p.numel() > 0 for p in block.module.parameters() if p.requires_grad)  # the LoRA stays put
    event = [e for e in RunReader(tmp_path / "swap").events() if e.get("kind") == "placement"]
    assert event and event[0]["blocks_swapped"] == 3


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


def test_more_blocks_than_the_model_has_fails_in_one_sentence(paths, shapes_dataset, tmp_path, one_thread):
    from stabletune_core.train.loop import setup

    config = build_config(dict(model_family="flux2_klein", pretrained_model_name_or_path=str(paths["folder"]),
                               train_data_dir=str(shapes_dataset), output_dir=str(tmp_path / "run"), resolution=64,
                               bucket_step=8, min_bucket_reso=32, max_bucket_reso=128, max_train_steps=1,
                               validation_split=0, gradient_checkpointing=True, blocks_to_swap=9))
    with pytest.raises(ConfigError) as caught:
        setup(config)
    assert caught.value.problems == ["blocks_to_swap 9 is more than the 4 blocks of this FLUX.2 Klein transformer; "
                                     "use at most 4."]


def test_out_of_memory_at_micro_batch_1_swaps_more_blocks_and_changes_no_number(paths, shapes_dataset, tmp_path,
                                                                                 one_thread):
    """The out-of-memory chain: micro-batch halves (2 -> 1), then a quarter of the blocks more are swapped (0 -> 1
    -> 2), each time the same step retried with the same random draws; never a change of the base's storage."""
    _, plain = klein_run(paths, shapes_dataset, tmp_path / "plain")
    from stabletune_core.train import faults

    faults.install("oom@2,oom@2,oom@3")
    try:
        session, survived = klein_run(paths, shapes_dataset, tmp_path / "oom")
    finally:
        faults.install(None)
    ooms = [e for e in RunReader(tmp_path / "oom").events() if e.get("kind") == "oom"]
    assert [(e["step"], e.get("new_micro_batch"), e.get("new_blocks_swapped")) for e in ooms] == [
        (2, 1, None), (2, None, 1), (3, None, 2)]
    assert "block swap" in ooms[1]["message"]
    swap: BlockSwap = session.bundle.extra["block_swap"]
    assert [b.index for b in swap.blocks] == [2, 3] and swap.resident == []
    assert swap.brought_in[2] >= 2 and swap.brought_in[3] > swap.brought_in[2]  # block 3 swapped since step 2
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
