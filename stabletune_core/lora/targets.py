"""Which Linear layers a family's LoRA target list selects, for the families whose target suffixes also name
containers or use '*' patterns (FLUX.2 Klein, Z-Image: ModelFamily.lora_target_modules); peft is not imported here,
so a family module that names its resolver stays light."""
from __future__ import annotations

import torch


def lora_target_modules(model: torch.nn.Module, targets: list[str]) -> list[str]:
    """The full names of the Linear layers `targets` select, in module order. A target is a name suffix (peft's
    rule: the name, or '.' + it at the end) or a pattern with '*' for one name part; a suffix that also names a
    non-Linear module (a double block's ``attn.to_out`` is a ModuleList) selects only the Linear layers, so peft is
    never asked to adapt a container. Targets that select nothing are left to inject.py's unmatched_targets."""
    import fnmatch

    chosen = []
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        for t in targets:
            if ("*" in t and (fnmatch.fnmatchcase(name, t) or fnmatch.fnmatchcase(name, "*." + t))) or \
                    name == t or name.endswith("." + t):
                chosen.append(name)
                break
    return chosen
