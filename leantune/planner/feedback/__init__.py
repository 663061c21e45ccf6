"""Runtime feedback: what the running trainer measures (peaks, step times, out-of-memory errors)
turned into corrections of the prediction and new plans. See ../__init__.py for the layout."""
