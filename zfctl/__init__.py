"""zfctl: command-line fine-tuning on the ZenFlow engine."""

__version__ = "0.1.0"
