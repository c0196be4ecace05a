"""modules/options.py of A1111 1.10: the settings categories (A1111 registers "training"; Forge does not:
FAKE_WEBUI_FLAVOR=forge leaves it out)."""
import os


class OptionsCategories:
    def __init__(self):
        self.mapping = {}

    def register_category(self, category_id, label, position=None):
        self.mapping.setdefault(category_id, label)
        return category_id


categories = OptionsCategories()
for _id, _label in (("saving", "Saving images"), ("sd", "Stable Diffusion"), ("ui", "User Interface"),
                    ("system", "System"), ("postprocessing", "Postprocessing")):
    categories.register_category(_id, _label)
if os.environ.get("FAKE_WEBUI_FLAVOR") != "forge":
    categories.register_category("training", "Training")
