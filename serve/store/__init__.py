"""The server's state in a database: SQLite files under --data-dir, or PostgreSQL for a fleet."""
