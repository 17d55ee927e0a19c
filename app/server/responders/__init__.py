"""One responder per API shape (chat completions, completions): a Generation's frames as that
shape's chunks, usage and JSON reply. A new shape is a new module here."""
