"""Learning rates per adapter kind, as measured on the toy demo: the demo trains with them (demo.py) and the
config's notes tell a LoHa / LoKr user how much higher than LoRA's their rate must be (schema.py `notes`)."""
from __future__ import annotations

#: (learning_rate, text_encoder_lr) per adapter kind with which the toy demo (demo.py) learns its concept in 400
#: steps. LoHa and LoKr move the weights less per step at the same rate (a Hadamard or Kronecker product of small
#: factors). Measured, purple 0 % -> at the end, base colours kept in every run: LoRA 1e-3: 100 %; LoHa 1e-3:
#: 33 %, 4e-3: 100 %; LoKr 1e-3: 0 %, 4e-3: 50 %, 1e-2: 100 % (nearest-colour judge). LoRA's text-encoder rate is
#: 3e-3 since issue 21.4: at 5e-4 the kept colours next to purple drifted twice as far, and on the v3 base
#: with snr_gamma 5 green drifts 2.2 deg at 3e-3 vs 3.4 at 2e-3 (presets/demo.toml).
TOY_DEMO_RATES = {"lora": (1e-3, 3e-3), "loha": (4e-3, 2e-3), "lokr": (1e-2, 5e-3)}
