"""The WebUI's model loader: only the unload the tab asks for."""
from _log import record


class ModelData:
    sd_model = "loaded checkpoint"


model_data = ModelData()


def unload_model_weights(sd_model=None, info=None):
    record("sd_models.unload_model_weights", had=model_data.sd_model)
    model_data.sd_model = None
