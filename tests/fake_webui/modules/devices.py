from _log import record


def torch_gc():
    record("devices.torch_gc")
