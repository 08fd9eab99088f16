__version__ = "0.1.0"
SGLANG_PIN = "0.5.23"
