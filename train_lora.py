"""Drop-in entry for commands written for diffusers' train_text_to_image_lora.py:

    accelerate launch train_lora.py --pretrained_model_name_or_path P --train_data_dir ./dataset ...

Every flag of that command is a TrainConfig field; see `python -m stabletune_core train --help`.
"""
import sys

from stabletune_core.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
