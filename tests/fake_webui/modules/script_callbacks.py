"""The two callback lists the StableTune tab uses, with the WebUI's calling convention."""
callbacks_ui_tabs = []
callbacks_ui_settings = []


def on_ui_tabs(callback):
    callbacks_ui_tabs.append(callback)


def on_ui_settings(callback):
    callbacks_ui_settings.append(callback)


def ui_tabs_callback():
    tabs = []
    for callback in callbacks_ui_tabs:
        tabs += callback() or []
    return tabs


def ui_settings_callback():
    for callback in callbacks_ui_settings:
        callback()


def clear_callbacks():
    callbacks_ui_tabs.clear()
    callbacks_ui_settings.clear()
