"""Expert offload: experts in host memory, computed on the CPU or streamed to the GPU."""

from moefx.offload.env import SETTINGS, EnvSetting, get_setting, setting_source, settings

__all__ = ["SETTINGS", "EnvSetting", "get_setting", "setting_source", "settings"]
