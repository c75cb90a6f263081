"""Expert offload: experts in host memory, computed on the CPU or streamed to the GPU.

`settings()` and its table (docs/OFFLOAD.md, "Environment knobs") are moefx/env.py's, named here as the docs name
them."""

from moefx.env import SETTINGS, EnvSetting, get_setting, setting_source, settings

__all__ = ["SETTINGS", "EnvSetting", "get_setting", "setting_source", "settings"]
