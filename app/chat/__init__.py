"""The chat screen: SQLite store, item model, controller and widgets."""
