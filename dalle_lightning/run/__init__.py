"""A run's lifecycle, apart from the commands that start one: its lock and directory, whether it starts afresh
or continues (a launcher's restart, ``resume=``), how it stops (SIGTERM, SIGINT, a lost peer) and what it says then."""
