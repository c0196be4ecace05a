"""opts / OptionInfo / cmd_opts as in A1111 1.10. FAKE_WEBUI_OPTS (JSON) plays the saved config.json."""
import argparse
import json
import os


class OptionInfo:
    def __init__(self, default=None, label="", component=None, component_args=None, onchange=None, section=None,
                 refresh=None, comment_before="", comment_after="", infotext=None, restrict_api=False,
                 category_id=None):
        self.default, self.label, self.section, self.category_id = default, label, section, category_id
        self.comment_after, self.reload_ui, self.do_not_save = comment_after, False, False

    def info(self, text):
        self.comment_after += f"({text})"
        return self

    def needs_reload_ui(self):
        self.reload_ui = True
        return self


class Options:
    def __init__(self, data):
        self.__dict__["data"] = dict(data)
        self.__dict__["data_labels"] = {}

    def add_option(self, key, info):
        self.data_labels[key] = info
        if key not in self.data and not info.do_not_save:
            self.data[key] = info.default

    def __getattr__(self, item):
        if item in self.data:
            return self.data[item]
        if item in self.data_labels:
            return self.data_labels[item].default
        raise AttributeError(item)


opts = Options(json.loads(os.environ.get("FAKE_WEBUI_OPTS", "{}")))
cmd_opts = argparse.Namespace(ckpt_dir=None, lora_dir=None, data_dir=os.environ.get("FAKE_WEBUI_ROOT"))
