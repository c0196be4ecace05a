import os

script_path = os.environ.get("FAKE_WEBUI_ROOT", os.getcwd())
data_path = script_path
models_path = os.path.join(data_path, "models")
extensions_dir = os.path.join(data_path, "extensions")
