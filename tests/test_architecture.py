"""The shape of the engine's training package (DESIGN.md, "Guards decide, the loop acts"), checked from the source.

- Nothing imports the loop but the entry point that runs it (cli.py); the loop imports its parts.
- No import cycle among the modules of stabletune_core/train, lazy (function-level) imports included.
- Guards look at a read-only view and return verdicts; the loop carries them out. Observers return observations.
"""
from __future__ import annotations

import ast
import inspect
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

CORE = Path(__file__).resolve().parent.parent / "stabletune_core"
TRAIN = CORE / "train"
LOOP = "stabletune_core.train.loop"
#: The entry points that run the loop; everything else is a part the loop uses.
LOOP_IMPORTERS = {"stabletune_core.cli"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(CORE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def type_checking_nodes(tree: ast.AST) -> set[int]:
    """Ids of nodes inside `if TYPE_CHECKING:` blocks: annotations only, never imported at run time."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                inside.update(id(n) for n in ast.walk(child))
    return inside


def imports_of(path: Path, *, type_only: bool = False) -> set[str]:
    """Every stabletune_core module `path` imports, at the top or inside a function, with the packages whose
    __init__ runs on the way (importing a.b.c runs a.b first); `type_only`: the annotation-only ones too."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = set() if type_only else type_checking_nodes(tree)
    here = module_name(path)
    package = here if is_package(path) else here.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            for alias in node.names:  # `from . import step` imports the module step
                candidate = f"{target}.{alias.name}"
                if (CORE.parent / Path(*candidate.split("."))).with_suffix(".py").exists() or \
                        (CORE.parent / Path(*candidate.split(".")) / "__init__.py").exists():
                    found.add(candidate)
    with_parents = set()
    for name in found:
        if not name.startswith("stabletune_core"):
            continue
        parts = name.split(".")
        with_parents.update(".".join(parts[:i]) for i in range(2, len(parts) + 1))
    ancestors = {".".join(here.split(".")[:i]) for i in range(1, here.count(".") + 2)}  # already running
    return with_parents - ancestors


def engine_modules() -> dict[str, Path]:
    return {module_name(p): p for p in CORE.rglob("*.py")}


def test_nothing_imports_the_loop_but_the_entry_point():
    importers = {name for name, path in engine_modules().items() if LOOP in imports_of(path)}
    assert importers == LOOP_IMPORTERS


def test_no_import_cycle_in_the_engine_lazy_and_type_only_imports_included():
    """A cycle hidden in a function-level import or an `if TYPE_CHECKING:` block is still a cycle of the design."""
    modules = engine_modules()
    graph = {name: {m for m in imports_of(path, type_only=True) if m in modules} for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


GUARD_MODULES = sorted((TRAIN / "guards").glob("*.py"))


@pytest.mark.parametrize("path", GUARD_MODULES, ids=lambda p: p.name)
def test_guards_never_save_export_or_move_the_step_counter(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    imported = imports_of(path)
    for forbidden in ("loop", "state", "lora_output", "run_files", "checkpoint", "step", "setup", "session"):
        assert f"stabletune_core.train.{forbidden}" not in imported, f"{path.name} imports train/{forbidden}.py"
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            text = ast.unparse(target)
            assert not text.endswith(("state.step", "micro_batch_size", "best_checkpoint")) or \
                text.startswith("self."), f"{path.name}:{node.lineno} assigns {text}"


# ---- guards return verdicts ------------------------------------------------------------------------------
def view(**values):
    """A GuardView with the numbers of a small run; keyword arguments override."""
    defaults = dict(step=3, max_steps=10, lr=1e-3, micro_batch_size=4, mixed_precision="no", scaler_active=False,
                    loss_scale=None, lora_layers=(), blocks_swapped=0, blocks_swappable=0)
    return SimpleNamespace(**{**defaults, **values})


def verdict_types(verdicts) -> list[str]:
    from stabletune_core.train.guards.verdicts import Verdict

    verdicts = list(verdicts)
    assert all(isinstance(v, Verdict) for v in verdicts), verdicts
    return [type(v).__name__ for v in verdicts]


def test_nonfinite_guard_decides_skip_snapshot_and_rollback():
    from stabletune_core.train.guards import NonFiniteGuard

    guard = NonFiniteGuard(window=4, max_bad=2, lr_factor=0.5, min_lr=1e-6)
    assert verdict_types(guard.on_start(view())) == ["TakeSnapshot"]
    assert verdict_types(guard.before_optimizer_step(view(), 0.5, 1.0)) == []
    assert verdict_types(guard.before_optimizer_step(view(), math.nan, math.nan)) == ["SkipStep"]
    rollback = guard.before_optimizer_step(view(step=4), 0.5, math.inf)
    assert verdict_types(rollback) == ["SkipStep", "RollBack"]
    assert rollback[1].bad_steps == (4, 5) and rollback[1].lr_factor == 0.5 and rollback[0].what == "gradients"
    overflow = guard.before_optimizer_step(view(scaler_active=True), 0.5, math.inf)
    assert verdict_types(overflow) == ["SkipStep"] and overflow[0].overflow
    assert verdict_types(guard.after_step(view(step=8), {})) == ["TakeSnapshot"]  # a clean window
    assert verdict_types(guard.after_step(view(step=7), {})) == []


def test_memory_guard_decides_shrink_then_stop():
    from stabletune_core.train.guards import MemGuard

    guard = MemGuard(retries=2)
    shrink = guard.on_out_of_memory(view(micro_batch_size=4), "CUDA out of memory", tries=0)
    assert verdict_types(shrink) == ["ShrinkMicroBatch"] and (shrink[0].old, shrink[0].new, shrink[0].step) == (4, 2, 4)
    assert verdict_types(guard.on_out_of_memory(view(micro_batch_size=1), "oom", tries=0)) == ["StopOutOfMemory"]
    stop = guard.on_out_of_memory(view(micro_batch_size=2), "oom", tries=2)
    assert verdict_types(stop) == ["StopOutOfMemory"] and "even with micro-batch 2" in stop[0].message


def test_precision_guard_decides_the_switch():
    from stabletune_core.train.guards import PrecisionGuard

    guard = PrecisionGuard(max_skips=2)
    fp16 = view(scaler_active=True, loss_scale=1024.0, mixed_precision="fp16")
    for _ in range(2):
        assert verdict_types(guard.before_optimizer_step(fp16, 0.5, math.inf)) == []
    switch = guard.after_step(fp16, metrics := {})
    assert verdict_types(switch) == ["SwitchPrecision"] and metrics["loss_scale"] == 1024.0
    assert switch[0].precision in ("bf16", "no") and switch[0].event.kind == "precision"
    resumed = PrecisionGuard(max_skips=2)
    resumed.load_state_dict(guard.state_dict())
    assert verdict_types(resumed.on_start(fp16)) == ["SwitchPrecision"]  # a resumed run switches again
    assert verdict_types(PrecisionGuard().after_step(view(), {})) == []  # no scaler, nothing to watch


def test_plateau_guard_decides_a_lower_rate():
    from stabletune_core.train.guards import PlateauGuard

    guard = PlateauGuard(patience=2, factor=0.5, min_lr=1e-4)
    decided = [verdict_types(guard.after_measuring(view(), {"val_loss": v})) for v in (1.0, 1.1, 1.2)]
    assert decided == [[], [], ["LowerLearningRate"]]
    assert verdict_types(guard.after_measuring(view(lr=1e-4), {"val_loss": 2.0})) == []
    assert verdict_types(guard.after_measuring(view(lr=1e-4), {"val_loss": 2.0})) == []  # at min_lr already


def test_early_stopping_guard_decides_save_best_trigger_stop_and_export(tmp_path):
    from stabletune_core.config import TrainConfig
    from stabletune_core.train.guards.early_stopping import EarlyStoppingGuard

    config = TrainConfig.model_construct(early_stopping_window=2, early_stopping_factor=1.1,
                                         early_stopping_patience=2, early_stopping_min_steps=0)
    guard = EarlyStoppingGuard(config)
    assert verdict_types(guard.on_start(view())) == ["ProtectCheckpoint"]
    seen = []
    for step, value in enumerate([1.0, 0.9, 1.5, 1.6], start=1):
        verdicts = guard.after_measuring(view(step=step), {"val_loss": value})
        seen.append(verdict_types(verdicts))
    assert seen == [["SaveBest"], ["SaveBest"], ["Report"], ["Report", "StopEarly"]]
    assert guard.best_step == 2  # the loop knows where step 2's checkpoint is; no call back into the guard
    resumed = EarlyStoppingGuard(config)
    resumed.load_state_dict(guard.state_dict())
    assert resumed.on_start(view())[0].step == 2
    at_the_end = guard.after_measuring(view(step=10, max_steps=10), {})
    assert verdict_types(at_the_end) == ["ExportBest"]


def test_clip_and_weight_norm_guards_leave_the_weights_to_the_loop():
    from peft import LoraConfig, inject_adapter_in_model

    from stabletune_core.train.guards import ClipGuard, WeightNormGuard

    clip = ClipGuard("fixed", max_norm=1.0)
    assert clip.max_grad_norm(view()) == 1.0
    assert verdict_types(clip.before_optimizer_step(view(), 0.5, 3.0)) == [] and clip.clipped == 1

    model = torch.nn.Sequential()
    model.add_module("proj", torch.nn.Linear(8, 8))
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=2, target_modules=["proj"], init_lora_weights=False),
                            model, adapter_name="default")
    from stabletune_core.lora.layers import iter_lora_layers

    guard = WeightNormGuard(max_norm=1e-3)
    layers = tuple(iter_lora_layers(model))
    assert verdict_types(guard.on_start(view(lora_layers=layers))) == []
    before = [p.detach().clone() for n, p in model.named_parameters() if "lora_" in n]
    verdicts = guard.after_step(view(lora_layers=layers), {})
    assert verdicts[0].layers == (0,) and 0 < verdicts[0].factors[0] < 1  # a handle and a factor, no tensor
    assert verdict_types(verdicts) == ["ScaleWeights"]
    assert all(torch.equal(a, p) for a, (n, p) in zip(before, ((n, p) for n, p in model.named_parameters()
                                                                 if "lora_" in n)))  # decided, not done


def test_guard_hooks_take_a_view_never_the_session():
    """Every hook of every guard takes `view: GuardView` (a few read-only numbers), not the session."""
    from stabletune_core.train import guards

    classes = [guards.ClipGuard, guards.MemGuard, guards.NonFiniteGuard, guards.PrecisionGuard, guards.PlateauGuard,
               guards.WeightNormGuard, guards.EarlyStoppingGuard]
    for cls in classes:
        for name in ("on_start", "before_optimizer_step", "after_step", "after_measuring", "on_out_of_memory",
                     "on_end"):
            method = getattr(cls, name, None)
            if method is None:
                continue
            params = list(inspect.signature(method).parameters.values())
            assert params[1].name == "view" and params[1].annotation == "GuardView", f"{cls.__name__}.{name}"
            assert inspect.signature(method).return_annotation == "Verdicts", f"{cls.__name__}.{name}"
        for name, member in inspect.getmembers(cls, inspect.isfunction):
            assert "s" not in inspect.signature(member).parameters, f"{cls.__name__}.{name} takes the session"


def test_observers_are_not_guards():
    from stabletune_core.config import TrainConfig
    from stabletune_core.train.observers.diagnostics import make_observers
    from stabletune_core.train.guards import Guard
    from stabletune_core.train.observers.base import Observer

    config = TrainConfig.model_construct(validation_loss_every=5, perceptual_lambda=0.1, diagnostics_every=5,
                                         activation_stats_every=5, collapse_threshold=0.05, validation_timesteps=4,
                                         validation_count=4)
    observers = make_observers(config)
    assert [o.name for o in observers] == ["validation_loss", "perceptual", "spectra", "activations"]
    assert all(isinstance(o, Observer) and not isinstance(o, Guard) for o in observers)


# ---- issue 14.2: the session is typed, not an untyped bag ----------------------------------------------------
def test_no_engine_function_takes_the_session_as_any():
    """Parts that get the session say so in their signature (`s: Session`); guards get a GuardView instead."""
    offenders = []
    for path in TRAIN.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in node.args.args + node.args.kwonlyargs:
                    if arg.arg in ("s", "view") and (arg.annotation is None or ast.unparse(arg.annotation) == "Any"):
                        offenders.append(f"{path.name}:{node.lineno} {node.name}({arg.arg})")
    assert not offenders, offenders


# ---- issue 14.4: one denoiser-forward-and-loss ------------------------------------------------------------------
def calls_to(path: Path, name: str) -> list[int]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call) and
            ast.unparse(node.func).split(".")[-1] == name]


def test_the_unet_is_called_in_one_place_and_the_loss_computed_in_one_helper():
    """Training, validation loss, the early-stopping/knob fixed-batch loss and the diagnostics probe all go
    through forward.predict (and predict_and_loss): what validation measures is what training optimises. The
    denoiser itself is called by the family's objective (models/), never by the engine."""
    unet_calls = {}
    for path in TRAIN.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and (ast.unparse(node.func) in ("unet", "denoiser") or
                                               ast.unparse(node.func).endswith(('["unet"]', ".unet", ".denoiser"))):
                unet_calls.setdefault(path.name, []).append(node.lineno)
    assert not unet_calls, unet_calls
    predict_users = {path.name for path in TRAIN.rglob("*.py") if calls_to(path, "predict") and
                     any("objective.predict(" in ast.unparse(n) for n in ast.walk(ast.parse(path.read_text())))}
    assert predict_users == {"forward.py"}, predict_users
    loss_users = {path.name for path in TRAIN.rglob("*.py") if calls_to(path, "per_sample_loss")}
    assert loss_users == {"forward.py"}, loss_users
    for user in ("step.py", "observers/validation_loss.py"):
        assert calls_to(TRAIN / user, "predict_and_loss"), user
    assert calls_to(TRAIN / "observers/validation_loss.py", "predict")  # the diagnostics probe (Evaluator.probe_forward)


# ---- issue 14.5: fault injection out of the hot path's shape -------------------------------------------------
def test_fault_injection_is_hooks_installed_at_setup_not_branches_in_the_step_or_the_checkpoint_writer():
    users = {}
    for path in TRAIN.rglob("*.py"):
        if path.name == "faults.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found = [ast.unparse(node) for node in ast.walk(tree)
                 if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "faults"]
        if found:
            users[path.name] = found
    assert users == {"setup.py": ["faults.arm"]}, users


def test_faults_reach_a_run_through_its_hooks(tiny_config, tmp_path):
    """nan_loss through a UNet forward hook, nan_grad through a gradient hook, and the checkpoint writer's
    halfway callback: the same faults as before, with the loop unaware of them."""
    from stabletune_core.runs.reader import RunReader
    from stabletune_core.train import faults
    from stabletune_core.train.loop import setup, train

    faults.install("nan_loss@2,nan_grad@3,disk_full@save:3")
    try:
        config = tiny_config(max_train_steps=4, save_steps=3, output_dir=str(tmp_path / "run"))
        s = setup(config)
        assert s.checkpoint_halfway is faults.during_checkpoint_write
        train(config, session=s)
    finally:
        faults.install(None)
    events = RunReader(tmp_path / "run").events()
    skipped = [(e["step"], e["what"]) for e in events if e["kind"] == "nonfinite"]
    assert skipped == [(2, "loss"), (3, "gradients")]
    assert [e["step"] for e in events if e["kind"] == "checkpoint_failed"] == [3]
    assert all(torch.isfinite(p).all() for p in s.params)
    clean = setup(tiny_config(max_train_steps=1, output_dir=str(tmp_path / "clean")))
    assert clean.checkpoint_halfway.__name__ == "nothing"  # no faults listed: nothing installed
    unet = clean.ranks.unwrap(clean.trained["unet"])
    assert not unet._forward_hooks and not unet._forward_pre_hooks


# ---- issue 22 A: the family's objective is the only DDPM there is --------------------------------------------------
def test_the_engine_asks_the_family_objective_and_knows_no_noise_schedule():
    """Noising, targets, timesteps, loss weights and latent scaling belong to the family (models/): nothing in
    train/ reads the DDPM scheduler's alphas or prediction type, or scales latents itself. (Sampling still builds
    its samplers from the scheduler's config.)"""
    forbidden = ("alphas_cumprod", "prediction_type", "add_noise", "get_velocity", "scaling_factor", "shift_factor",
                 "latent_scaling", "num_train_timesteps", "latent_dist")
    found = {}
    for path in TRAIN.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if name in forbidden:
                found.setdefault(path.name, set()).add(name)
    assert not found, found


# ---- issue 22.1: guards decide, completely -------------------------------------------------------------------------
def guard_classes():
    from stabletune_core.train import guards

    return [guards.ClipGuard, guards.MemGuard, guards.NonFiniteGuard, guards.PrecisionGuard, guards.PlateauGuard,
            guards.WeightNormGuard, guards.EarlyStoppingGuard]


def test_no_guard_is_looked_up_by_name_and_the_loop_calls_only_hooks_of_the_guard_base():
    """The loop treats every guard alike: no `s.guard("memory")`, no `guard.name == ...`, and every method the
    loop (or any other part of train/) calls on a guard is a hook of guards/base.py `Guard`."""
    from stabletune_core.train.guards import Guard

    hooks = {name for name, _ in inspect.getmembers(Guard, inspect.isfunction)}
    for path in TRAIN.rglob("*.py"):
        if path.parent.name == "guards":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner, method = ast.unparse(node.func.value), node.func.attr
                assert method != "guard", f"{path.name}:{node.lineno} looks a guard up by name"
                if owner in ("guard", "memory", "nonfinite", "clip"):
                    assert method in hooks, f"{path.name}:{node.lineno} calls {owner}.{method}, not a Guard hook"
            if isinstance(node, ast.Compare) and "name" in ast.unparse(node.left) and \
                    any(isinstance(c, ast.Constant) and c.value in {"memory", "nonfinite", "clipping"}
                        for c in node.comparators):
                raise AssertionError(f"{path.name}:{node.lineno} picks a guard by its name")


def test_early_stopping_lives_in_guards_and_needs_no_call_back_from_the_loop():
    assert not (TRAIN / "early_stopping.py").exists() and (TRAIN / "guards" / "early_stopping.py").exists()
    for cls in guard_classes():
        public = {name for name, _ in inspect.getmembers(cls, inspect.isfunction) if not name.startswith("_")}
        from stabletune_core.train.guards import Guard

        extra = public - {name for name, _ in inspect.getmembers(Guard, inspect.isfunction)}
        assert "remember_best" not in public and "hopeless" not in public, cls.__name__
        assert not any(name.startswith(("remember", "set_")) for name in extra), (cls.__name__, extra)


def test_the_clip_threshold_is_read_without_writing_state():
    from stabletune_core.train.guards import ClipGuard

    guard = ClipGuard("adaptive", max_norm=0, percentile=90, window=20)
    for norm in range(1, 31):
        guard.before_optimizer_step(view(), 1.0, float(norm))
    before = {k: (list(v) if hasattr(v, "__iter__") else v) for k, v in vars(guard).items()}
    assert guard.max_grad_norm(view()) == guard.max_grad_norm(view())
    assert {k: (list(v) if hasattr(v, "__iter__") else v) for k, v in vars(guard).items()} == before


def test_a_hopeless_run_is_a_verdict():
    from stabletune_core.config import build_config
    from stabletune_core.train.guards import NonFiniteGuard

    guard = NonFiniteGuard.from_config(build_config({"nan_max_bad": 2, "learning_rate": 1e-3}))
    verdicts = []
    for step in range(8):
        guard.before_optimizer_step(view(step=step), math.nan, math.nan)
        verdicts += guard.after_step(view(step=step + 1), {})
    assert "StopDiverged" in verdict_types(verdicts)
    message = next(v for v in verdicts if type(v).__name__ == "StopDiverged").message
    assert message.startswith("Training diverged: all 8 training steps") and "lower learning_rate" in message
    end = NonFiniteGuard(window=4, max_bad=100)
    end.before_optimizer_step(view(), math.nan, math.nan)
    assert verdict_types(end.on_end(view())) == ["StopDiverged"]  # no finite step in the whole run
    assert verdict_types(NonFiniteGuard().on_end(view())) == []  # a run that took no step


def test_guards_keep_no_live_tensor_of_the_run(tiny_config):
    """After on_start and a step's hooks on a real session, nothing a guard holds is (or views) a trained
    parameter: they get handles (indices into the view's LoRA layers) and copies."""
    from stabletune_core.train.loop import setup
    from stabletune_core.train.session import SessionView

    s = setup(tiny_config(scale_weight_norms=1.0, clip_mode="adaptive", early_stopping=True,
                          validation_loss_every=1, lr_scheduler="plateau"))
    live = {p.untyped_storage().data_ptr() for p in s.params}
    v = SessionView(s)
    for guard in s.guards:
        guard.on_start(v)
        guard.before_optimizer_step(v, 1.0, 1.0)
        guard.after_step(v, {})

    def tensors(obj, depth=0):
        if isinstance(obj, torch.Tensor):
            yield obj
        elif depth < 4 and isinstance(obj, (list, tuple, set)):
            for item in obj:
                yield from tensors(item, depth + 1)
        elif depth < 4 and isinstance(obj, dict):
            for item in obj.values():
                yield from tensors(item, depth + 1)
        elif depth < 4 and hasattr(obj, "__dict__") and not isinstance(obj, torch.nn.Module):
            yield from tensors(vars(obj), depth + 1)

    assert {g.name for g in s.guards} >= {"clipping", "nonfinite", "weight_norms", "early_stopping", "plateau"}
    for guard in s.guards:
        held = [t for t in tensors(vars(guard)) if t.untyped_storage().data_ptr() in live]
        assert not held, f"{guard.name} keeps {len(held)} live tensors of the run"
        assert not any(isinstance(x, torch.nn.Module) for x in vars(guard).values()), guard.name


# ---- issue 22.3: the session is wiring; the step's helpers take what they use -------------------------------------
def test_no_function_in_train_takes_the_whole_session_but_setup_and_the_loop():
    """(And the read-only view the loop hands guards and observers, session.SessionView.)"""
    offenders = []
    for path in TRAIN.rglob("*.py"):
        if path.name in ("loop.py", "setup.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for arg in node.args.args + node.args.kwonlyargs:
                    if arg.annotation is not None and ast.unparse(arg.annotation).strip("'\"") == "Session":
                        offenders.append(f"{path.name}:{node.lineno} {node.name}({arg.arg})")
    assert [o.split(" ", 1)[1] for o in offenders] == ["__init__(session)"] and offenders[0].startswith(
        "session.py:"), offenders  # SessionView's


def test_the_session_is_frozen_wiring_and_the_state_is_the_mutable_part():
    import dataclasses

    from stabletune_core.train.session import Session, TrainState

    assert Session.__dataclass_params__.frozen and not TrainState.__dataclass_params__.frozen
    names = {f.name for f in dataclasses.fields(Session)}
    assert {"generator", "weight_dtype", "snapshot", "best_checkpoint", "feed_position", "loss_parts",
            "sample_scores", "tensorboard", "accelerator"}.isdisjoint(names)


def test_all_multi_rank_code_is_in_ranks_py():
    """Agreement, gradient sums and broadcasts go through train/ranks.py: nothing else in the engine calls
    accelerate's collectives or asks how many processes there are."""
    collectives = {"reduce", "gather", "gather_object", "broadcast_object_list", "wait_for_everyone", "num_processes",
                   "all_reduce", "broadcast", "process_index", "is_main_process"}
    found = {}
    for path in CORE.rglob("*.py"):
        if path == TRAIN / "ranks.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            name = node.attr if isinstance(node, ast.Attribute) else (
                node.names[0].name if isinstance(node, ast.ImportFrom) and node.module and
                node.module.startswith("accelerate") else None)
            if name in collectives:
                found.setdefault(str(path.relative_to(CORE)), set()).add(name)
    assert not found, found


# ---- issue 22.6: one run-dir contract shared by engine and UI ---------------------------------------------------
RUN_FILE_NAMES = ("config.toml", "status.json", "metrics.jsonl", "events.jsonl", "control.json", "train.log",
                  "traceback.txt", "spectra.jsonl", "activations.jsonl", "val_loss.jsonl", "warnings.jsonl")


def string_constants(path: Path) -> list[tuple[int, str]]:
    """String literals of a module that are not docstrings, widget labels or dict keys (a UI part may be called
    "train.log"; that names no file)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = {id(node.body[0].value) for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body and
            isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript):
            skip.add(id(node.slice))
        elif isinstance(node, ast.keyword) and node.arg == "label":
            skip.add(id(node.value))
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip]


def test_run_dir_file_names_are_spelled_only_in_runs_layout():
    spelled = []
    for path in [*CORE.rglob("*.py"), *(CORE.parent / "extension").rglob("*.py")]:
        if path == CORE / "runs" / "layout.py":
            continue
        for line, text in string_constants(path):
            if any(text == name or text.endswith("/" + name) for name in RUN_FILE_NAMES):
                spelled.append(f"{path.relative_to(CORE.parent)}:{line} {text!r}")
    assert not spelled, spelled


def test_event_kinds_come_from_the_registry_and_say_what_happened(tmp_path):
    """Every event the engine writes names a kind of runs/events.py (a typo is refused); the three "resume" kinds
    that meant three different things are gone."""
    from stabletune_core.runs import events
    from stabletune_core.runs.writer import RunWriter

    assert {"resume", "resume_run", "resumed"}.isdisjoint(events.EVENT_KINDS)
    assert {events.UNPAUSED, events.RESUMED_FROM_CHECKPOINT, events.NOTHING_TO_RESUME} <= events.EVENT_KINDS
    with pytest.raises(ValueError, match="not an event kind"):
        RunWriter(tmp_path / "run").event("resumed", "a kind that is not in the registry")
    literal_kinds = []
    for path in CORE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and (ast.unparse(node.func).endswith(".event") or
                                               ast.unparse(node.func) == "Event") and node.args and \
                    isinstance(node.args[0], ast.Constant):
                literal_kinds.append(f"{path.name}:{node.lineno} {node.args[0].value!r}")
    assert not literal_kinds, literal_kinds


# ---- issue 22.4/22.5: config and data cut by job; one TrainConfig read, never knobs re-declared --------------------
def test_config_is_cut_by_job_and_imports_no_torch():
    import subprocess
    import sys

    folder = CORE / "config"
    assert not (CORE / "config.py").exists()
    assert {p.stem for p in folder.glob("*.py")} == {"__init__", "schema", "files", "world", "flags", "resolve",
                                                     "families", "tokens", "judges", "network_rates", "hosts"}
    code = ("import sys; from stabletune_core.config import TrainConfig, build_config, ConfigError, check_inputs, "
            "add_config_arguments, resolve, PATH_KNOBS; from stabletune_core.config.families import "
            "family_problems; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=CORE.parent)


def test_data_is_cut_by_job_and_masks_follow_the_examples_placement():
    data = CORE / "data"
    assert not (data / "dataset.py").exists()
    assert {"seeds", "order", "examples", "loader", "caches"} <= {p.stem for p in data.glob("*.py")}
    called = {ast.unparse(node.func).split(".")[-1] for node in ast.walk(ast.parse((data / "masks.py").read_text()))
              if isinstance(node, ast.Call)}
    assert not called & {"crop_geometry", "derive_seed", "Random"}, "masks.py re-derives the example's crop or flip"


def test_dataset_view_and_query_cli_take_a_train_config_and_declare_no_knob():
    from stabletune_core.data import DatasetView

    assert list(inspect.signature(DatasetView).parameters) == ["scan", "config"]
    tree = ast.parse((CORE / "query_cli.py").read_text(encoding="utf-8"))
    declared = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Call) and
                ast.unparse(node.func).endswith("add_argument") and any(k.arg == "default" for k in node.keywords)]
    assert not declared, declared


def test_report_to_is_a_choice_refused_before_anything_loads():
    from stabletune_core.config import ConfigError, build_config

    with pytest.raises(ConfigError, match="report_to is 'wandb'; choose one of"):
        build_config({"report_to": "wandb"})
    assert build_config({"report_to": "all"}).report_to == "tensorboard"


# ---- issue 22.7: one helper per job, no dead code, no broad except that hides a bug --------------------------------
def defined(name: str) -> list[str]:
    return [f"{path.relative_to(CORE)}" for path in CORE.rglob("*.py")
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name == name]


def test_one_helper_per_job():
    assert defined("signal_name") == ["train/signals.py"]
    assert defined("sha256_file") == ["digest.py"]
    assert defined("precision_dtype") == ["train/amp.py"]
    scaled = {str(path.relative_to(CORE)) for path in CORE.rglob("*.py") if path.relative_to(CORE).parts[0] != "toy"
              for _, text in [(0, path.read_text(encoding="utf-8"))] if "scaling_factor" in text and
              not path.name.startswith("tiny")}  # the tiny builders write it into their VAE configs
    assert scaled == {"models/base.py"}, scaled  # the one latent (de)normalisation, which the family calls
    dtypes = {str(path.relative_to(CORE)) for path in TRAIN.rglob("*.py") if "torch.bfloat16" in path.read_text()}
    assert dtypes <= {"train/amp.py", "train/guards/precision.py"}, dtypes


def never_called(sources: dict[Path, str], defining: list[Path]) -> list[str]:
    """Module-level functions and classes, and methods, of `defining` whose name appears nowhere but in its own
    definition across `sources` (the product, its tests and benches): code nothing can reach. Decorated methods
    (validators, properties, hooks a library calls by registration) are reached through their decorator."""
    import re
    from collections import Counter

    mentions = Counter(word for text in sources.values() for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))
    # Methods that a library's base class calls by name (nn.Module.extra_repr, autograd.Function.backward, ...)
    library_hooks = {name for base in (torch.nn.Module, torch.autograd.Function) for name in dir(base)}
    unreached = []
    for path in defining:
        for node in ast.parse(sources[path]).body:
            members = [node]
            if isinstance(node, ast.ClassDef):
                members += [sub for sub in node.body if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef))
                            and not sub.name.startswith("__") and not sub.decorator_list
                            and sub.name not in library_hooks]
            for member in members:
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
                        mentions[member.name] <= 1:
                    unreached.append(f"{path.name}:{member.lineno} {member.name}")
    return unreached


def test_no_function_or_class_of_the_product_is_unreachable(tmp_path):
    """Dead code is found, not listed: a definition whose name nothing else mentions (not a caller, not a test,
    not a bench) fails the test. The check itself is shown to catch a planted dead function."""
    repo = CORE.parent
    defining = [*CORE.rglob("*.py"), *(repo / "extension").rglob("*.py")]
    readers = [*defining, repo / "app.py", repo / "install.py", repo / "train_lora.py",
               *(repo / "scripts").rglob("*.py"), *(repo / "bench").rglob("*.py"), *(repo / "tests").rglob("*.py")]
    sources = {path: path.read_text(encoding="utf-8") for path in readers}
    assert never_called(sources, defining) == []
    planted, name = tmp_path / "planted.py", "_".join(("a", "helper", "nobody", "calls"))  # spelled nowhere whole
    sources[planted] = f"def {name}():\n    return 1\n"
    assert never_called(sources, [planted]) == [f"planted.py:1 {name}"]


def test_no_broad_except_hides_a_bug_in_the_engine_parts_of_this_issue():
    """`except Exception` only where the traceback is kept (query_cli saves it to a file it names)."""
    broad = []
    for path in [*TRAIN.rglob("*.py"), *(CORE / "data").rglob("*.py"), *(CORE / "config").rglob("*.py"),
                 *(CORE / "runs").rglob("*.py"), CORE / "query_cli.py", CORE / "launch.py", CORE / "cli.py"]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ExceptHandler) and node.type is not None and \
                    ast.unparse(node.type) in ("Exception", "BaseException"):
                body = ast.unparse(node)
                if "save_traceback" not in body and "report_failure" not in body and "raise" not in body:
                    broad.append(f"{path.relative_to(CORE)}:{node.lineno}")
    assert not broad, broad


# ---- issue 22.8: names that do not mislead ------------------------------------------------------------------
def test_module_names_say_what_they_hold():
    names = {str(p.relative_to(TRAIN)) for p in TRAIN.rglob("*.py")}
    for misleading in ("memory.py", "guards/memory.py", "validation.py", "sampling.py", "export.py", "guards/lr.py",
                       "schedule.py", "early_stopping.py"):
        assert misleading not in names, misleading
    assert {"memory_stats.py", "guards/out_of_memory.py", "observers/validation_loss.py", "validation_images.py",
            "lora_output.py", "guards/plateau.py", "lr_schedule.py", "guards/early_stopping.py"} <= names
    assert {p.stem for p in (TRAIN / "observers").glob("*.py")} == {"__init__", "base", "validation_loss",
                                                                   "diagnostics", "tensorboard", "perceptual_report",
                                                                   "sample_judge", "perceptual_drift"}


# ---- issue 38.3: the run folder in one place ----------------------------------------------------------------------
#: Names under RUN/ beyond RUN_FILE_NAMES: sampling folders and their files, checkpoint files, the demo's gallery.
RUN_FOLDER_NAMES = ("prompts.json", "manifest.json", "adapter.safetensors", "state.pt", "gallery.png",
                    "image_losses.jsonl", "step_*", "step_")
#: f-strings that build a run-folder name: step_NNNNNN, p00_s42.png, the LoRA variants, checkpoint temporaries.
RUN_FOLDER_PATTERNS = (r"step_\{", r"_s\{[^}]*\}\.png", r"\}(-ema|_best|_diffusers|_embeddings)\b", r"\}_step\{",
                       r"\.(tmp|old)_\{")
RUN_FOLDERS = ("samples", "checkpoints", "output", "diagnostics", "grids", "tensorboard", "cache")
#: Same words, other folders: the shipped toy bases' own manifest.json, torch hub's checkpoints/.
NOT_THE_RUN = {("stabletune_core/toy/__init__.py", "manifest.json"), ("stabletune_core/toy/flow_base.py", "manifest.json"),
               ("stabletune_core/toy/build.py", "manifest.json"), ("stabletune_core/train/perceptual.py", "checkpoints")}


def test_every_run_folder_name_comes_from_runs_layout():
    import re

    spelled = []
    for path in [*CORE.rglob("*.py"), *(CORE.parent / "extension").rglob("*.py")]:
        if path == CORE / "runs" / "layout.py":
            continue
        where = str(path.relative_to(CORE.parent))
        for line, text in string_constants(path):
            if any(text == name for name in RUN_FOLDER_NAMES) and (where, text) not in NOT_THE_RUN:
                spelled.append(f"{where}:{line} {text!r}")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.JoinedStr) and any(re.search(p, ast.unparse(node)) for p in RUN_FOLDER_PATTERNS):
                spelled.append(f"{where}:{node.lineno} {ast.unparse(node)}")
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant) \
                    and node.right.value in RUN_FOLDERS and (where, node.right.value) not in NOT_THE_RUN:
                spelled.append(f"{where}:{node.lineno} {ast.unparse(node)}")
    assert not spelled, spelled


def test_run_folder_names_round_trip_through_run_paths(tmp_path):
    from stabletune_core.runs.layout import RunPaths, sample_image_place, step_of

    paths = RunPaths(tmp_path)
    for step in (0, 7, 123456):
        assert step_of(paths.checkpoint(step)) == step and step_of(paths.sample_dir(step)) == step
    assert sample_image_place(paths.sample_image(3, 1, 42).stem) == (1, 42)
    for step in (10, 2, 300):
        paths.checkpoint(step).mkdir(parents=True)
    (paths.checkpoints / "step_notanumber").mkdir()
    assert [step_of(p) for p in paths.checkpoint_folders()] == [2, 10, 300]  # by step, other names left out


def test_status_states_and_control_commands_come_from_one_registry(tmp_path, capsys):
    """The writer refuses a state and the reader a command outside runs/states.py; a command the UI never sends is
    ignored with a console line (it used to be dropped without a word); FINAL_STATES is defined once."""
    from stabletune_core.runs.reader import RunReader
    from stabletune_core.runs.states import CONTROL_COMMANDS, FINAL_STATES, STATES
    from stabletune_core.runs.writer import RunWriter, record_outcome

    writer = RunWriter(tmp_path / "run")
    with pytest.raises(ValueError, match="not a run state"):
        writer.status("traning")
    with pytest.raises(ValueError, match="not a run state"):
        record_outcome(tmp_path / "run", "crashed", "no")
    with pytest.raises(ValueError, match="not a control command"):
        RunReader(tmp_path / "run").send("halt")
    writer.paths.control.write_text('{"command": "halt"}')
    assert writer.take_control() is None and "Ignored control.json" in capsys.readouterr().err
    for command in CONTROL_COMMANDS:
        RunReader(tmp_path / "run").send(command)
        assert writer.take_control()["command"] == command
    assert set(FINAL_STATES) <= set(STATES)
    assigned = [f"{path.relative_to(CORE)}" for path in CORE.rglob("*.py")
                for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                if isinstance(node, ast.Assign) and any(ast.unparse(t) == "FINAL_STATES" for t in node.targets)]
    assert assigned == ["runs/states.py"]


def test_the_per_image_loss_record_belongs_to_the_run_folder_not_a_tool():
    assert defined("loss_record") == ["runs/image_losses.py"]
    assert not any(m.startswith("stabletune_core.tools") for m in imports_of(TRAIN / "loop.py"))


# ---- issue 38.4: layers point down ------------------------------------------------------------------------------
LOWER_LAYERS = ("config", "runs", "data", "models", "lora")
HIGHER_LAYERS = ("train", "tools", "toy", "grid", "cli")


def test_lower_layers_import_nothing_from_the_higher_ones():
    """config, runs, data, models and lora never import train, tools, toy, grid or cli: not at the top, not inside
    a function, not for annotations only."""
    upward = []
    for layer in LOWER_LAYERS:
        for path in sorted((CORE / layer).rglob("*.py")):
            for name in imports_of(path, type_only=True):
                if name.split(".")[1] in HIGHER_LAYERS:
                    upward.append(f"{path.relative_to(CORE)} -> {name}")
    assert not upward, upward



def test_the_shared_layers_ask_the_family_and_import_nothing_of_models():
    """config, runs, data and lora serve every family and sit below models/: the family folders import lora's
    primitives for their LoRA names, so what one family does differently (FLUX.2's fused kohya names, its LoKr names)
    the shared layers ask the family object for (ModelFamily.fused_lora_export), and lora names what it needs of a
    model as a Protocol (lora/inject.py AdaptableModel): an import back up would be a circle."""
    upward = []
    for layer in ("config", "runs", "data", "lora"):
        for path in sorted((CORE / layer).rglob("*.py")):
            for name in imports_of(path, type_only=True):
                if name.split(".")[1:2] == ["models"]:
                    upward.append(f"{path.relative_to(CORE)} -> {name}")
    assert not upward, upward

def test_leftovers_merged_and_names_say_what_a_thing_is():
    import dataclasses

    from stabletune_core.models.base import ModelBundle

    assert defined("sha256") == []  # toy/build.py's second file hash: digest.sha256_file is the one
    assert not (TRAIN / "lora_file.py").exists() and (TRAIN / "lora_output.py").exists()  # tools/lora_file.py reads
    assert "denoiser" in {f.name for f in dataclasses.fields(ModelBundle)}
    assert not any("PerceptualReport" in n for n in dir(__import__("stabletune_core.train.perceptual",
                                                                   fromlist=["*"])))


def test_the_thread_line_calls_kleins_transformer_a_transformer(monkeypatch):
    """37.8: a FLUX.2 Klein run's console line said "a UNet of 0.1 M parameters"."""
    from diffusers import Flux2Transformer2DModel

    from stabletune_core.models.sd.tiny import build_tiny_components
    from stabletune_core.models.flux2_klein.tiny import TRANSFORMER_CONFIG
    from stabletune_core.train.threads import set_cpu_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    try:
        _, klein = set_cpu_threads(Flux2Transformer2DModel(**TRANSFORMER_CONFIG))
        _, sd = set_cpu_threads(build_tiny_components()["unet"])
    finally:
        torch.set_num_threads(before)
    assert "a transformer of" in klein and "UNet" not in klein
    assert "a UNet of" in sd


# ---- issue 39.1: the family face is declared, never probed ------------------------------------------------------
def test_every_family_has_every_part_of_the_declared_face_and_nobody_probes_for_one():
    """models/base.py's ModelFamily declares what callers use; each registered family has each declared attribute
    and method, and no module outside models/ asks a family with getattr(..., default) (a probe hides a family
    that lacks a part until a user meets the default)."""
    from stabletune_core.models import FAMILIES, get_family
    from stabletune_core.models.base import ModelFamily

    declared = set(ModelFamily.__annotations__) | {name for name, member in vars(ModelFamily).items()
                                                   if callable(member) and not name.startswith("_")}
    missing = {name: sorted(part for part in declared if not hasattr(get_family(name), part)) for name in FAMILIES}
    assert not any(missing.values()), missing
    probes = []
    for path in CORE.rglob("*.py"):
        if path.relative_to(CORE).parts[0] == "models":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "getattr" and node.args and \
                    "family" in ast.unparse(node.args[0]):
                probes.append(f"{path.relative_to(CORE)}:{node.lineno} {ast.unparse(node)}")
    assert not probes, probes


# ---- issue 38.1: the loop is the loop and the carrying-out of verdicts --------------------------------------------
#: loop.py's length: the loop, one step, the verdicts carried out and one-line bindings of the session to its hands.
LOOP_MAX_LINES = 330


def functions_of(path: Path) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in ast.parse(path.read_text(encoding="utf-8")).body
            if isinstance(node, ast.FunctionDef)}


def test_the_loop_holds_the_loop_and_hands_the_rest_to_modules_that_take_records():
    """Sampling, the run's files, the UI's commands and the preflight are done elsewhere, by functions that take small
    frozen records the session gives (StepParts, RunFiles, Sampler), never the session; the loop binds the session
    to them in a line or two each."""
    lines = (TRAIN / "loop.py").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= LOOP_MAX_LINES, f"loop.py has {len(lines)} lines (at most {LOOP_MAX_LINES})"
    doing = {"write_checkpoint", "write_lora", "make_validation_images", "make_samples", "make_deferred",
             "take_command", "preflight", "restore_snapshot", "load_checkpoint", "RunFiles", "Sampler", "StepParts"}
    done_in_the_loop = {name for name in doing if calls_to(TRAIN / "loop.py", name)}
    assert not done_in_the_loop, done_in_the_loop
    hands = ("save", "resume", "export", "export_best", "run_preflight", "sample", "obey_control", "forward_backward")
    functions = functions_of(TRAIN / "loop.py")
    for name in hands:
        body = [n for n in functions[name].body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
        assert len(body) <= 2, f"loop.{name} does the work itself ({len(body)} statements): hand it to its module"
    from stabletune_core.train.run_files import RunFiles
    from stabletune_core.train.samples import Sampler
    from stabletune_core.train.session import Session
    from stabletune_core.train.step import StepParts

    given = {name: inspect.signature(member.fget).return_annotation
             for name, member in vars(Session).items() if isinstance(member, property)}
    for record in (StepParts, RunFiles, Sampler):
        assert record.__dataclass_params__.frozen and record.__name__ in given.values(), record


# ---- issue 38.2: set-up as a table of contents ---------------------------------------------------------------------
#: The phases of setup(), in order; each returns a small frozen record (check: the family object).
SETUP_PHASES = ("check", "prepare_run_dir", "resolve_run", "open_run", "build_data", "load_base_model",
                "build_adapters", "build_optimizer_and_feed", "build_watchers", "session_of")


def test_setup_is_a_short_list_of_named_phases_each_returning_a_frozen_record():
    import dataclasses

    from stabletune_core.train import setup as setup_module

    node = functions_of(TRAIN / "setup.py")["setup"]
    body = node.body[1:] if isinstance(node.body[0], ast.Expr) else node.body  # less the docstring
    length = body[-1].end_lineno - body[0].lineno + 1
    assert length <= 40, f"setup() is {length} lines: a table of contents reads in a glance"
    called = [ast.unparse(n.func) for n in ast.walk(node) if isinstance(n, ast.Call)]
    phases = [name for name in called if name in SETUP_PHASES]
    assert sorted(phases, key=SETUP_PHASES.index) == list(SETUP_PHASES), called
    for name in SETUP_PHASES[2:-1]:
        returned = inspect.signature(getattr(setup_module, name)).return_annotation
        record = getattr(setup_module, returned)
        assert dataclasses.is_dataclass(record) and record.__dataclass_params__.frozen, f"{name} -> {returned}"
        assert len(dataclasses.fields(record)) <= 8, f"{returned} is not small"


def test_the_step_helpers_take_a_handful_of_explicit_arguments():
    """The step's parts are one frozen record (step.StepParts); a step helper takes a few arguments."""
    from stabletune_core.train import step

    for name, function in inspect.getmembers(step, inspect.isfunction):
        if function.__module__ == step.__name__:
            parameters = inspect.signature(function).parameters
            assert len(parameters) <= 6, f"step.{name} takes {len(parameters)} arguments: {list(parameters)}"
    assert step.StepParts.__dataclass_params__.frozen


def test_setup_asks_the_family_and_never_compares_its_name_with_a_string():
    from stabletune_core.models import FAMILIES

    compared = [f"setup.py:{node.lineno} {ast.unparse(node)}"
                for node in ast.walk(ast.parse((TRAIN / "setup.py").read_text(encoding="utf-8")))
                if isinstance(node, ast.Compare) and any(isinstance(part, ast.Constant) and part.value in FAMILIES
                                                         for part in [node.left, *node.comparators])]
    assert not compared, compared


def test_resolve_folds_in_the_family_defaults_and_touches_nothing(tmp_path, monkeypatch):
    """The pure resolve: the family's defaults (a flow family's LoRA targets and guidance) and the seed drawn for -1
    go into the config; nothing is read from a device (no plan without vram_gb or a measured card), no file written."""
    from stabletune_core.config import TrainConfig
    from stabletune_core.config.families import KLEIN_LORA_TARGETS, SD_LORA_TARGETS
    from stabletune_core.models import get_family
    from stabletune_core.train.setup import resolve_run

    monkeypatch.chdir(tmp_path)
    config = TrainConfig(pretrained_model_name_or_path=str(tmp_path / "model"), train_data_dir=str(tmp_path / "data"),
                         output_dir=str(tmp_path / "run"), seed=-1)
    klein = resolve_run(config, get_family("flux2_klein"), measured=None, random_seed=1234)
    assert list(klein.config.unet_lora_targets) == list(KLEIN_LORA_TARGETS) and klein.config.seed == 1234
    assert klein.plan is None and klein.config.validation_guidance_scale != config.validation_guidance_scale
    sd = resolve_run(config, get_family("sd1"), measured=None, random_seed=7)
    assert list(sd.config.unet_lora_targets) == list(SD_LORA_TARGETS) and sd.config.seed == 7
    assert list(tmp_path.iterdir()) == []
    assert get_family("flux2_klein").plans_memory and get_family("z_image").plans_memory
    assert not get_family("sd1").plans_memory
