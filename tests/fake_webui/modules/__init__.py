"""Fake of the WebUI's `modules` package (see tests/fake_webui/README.md)."""
