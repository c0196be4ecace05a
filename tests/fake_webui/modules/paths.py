from modules.paths_internal import data_path, extensions_dir, models_path, script_path  # noqa: F401
