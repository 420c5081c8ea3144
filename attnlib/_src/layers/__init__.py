"""The Equinox and Haiku layers (`equinox/`, `haiku/`) and what they share (`_common.py`)."""
