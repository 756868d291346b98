"""The core app every other app builds on: jobs, the transition guard, live updates, the page shell."""
