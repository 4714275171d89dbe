"""Rule files: the default rules ship here; users copy and edit them."""
