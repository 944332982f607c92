"""The engine loop: schedule -> execute -> update."""
