"""The engine core: pure Python + numpy, never imports torch."""
