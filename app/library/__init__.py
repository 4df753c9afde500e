"""The model library screen: table model, widgets, import dialog and controller."""
