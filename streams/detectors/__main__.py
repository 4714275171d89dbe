"""``python -m trainguard.streams.detectors``: the tables of docs/detectors.md."""

from trainguard.streams.detectors import markdown

print(markdown(), end="")
