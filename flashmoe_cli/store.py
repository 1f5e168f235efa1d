"""Conversations on disk: one SQLite database, a row per message written as it happens.

Each message is committed on its own, so a crash loses nothing that was shown: a reply's row is
written as it starts (`complete` 0), its text updated as it streams (ChatSession throttles that),
and marked complete at its end. A row still incomplete is a reply whose process died mid-way.
Migrations are an append-only list: the database records how many have run.
Text is written with lone surrogates (bytes that were not UTF-8) as U+FFFD: sqlite3 would refuse
it, and the front ends' own decoding (utf8.py) must not be the only thing keeping a save alive.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from .utf8 import scrub

MIGRATIONS = [
    """
    CREATE TABLE conversations (
        id TEXT PRIMARY KEY,
        created REAL NOT NULL,
        model TEXT,
        system TEXT,
        title TEXT
    );
    CREATE TABLE messages (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        conversation_id TEXT NOT NULL REFERENCES conversations(id),
        created REAL NOT NULL,
        role TEXT NOT NULL,
        content TEXT NOT NULL,
        interrupted INTEGER NOT NULL DEFAULT 0,
        stats TEXT
    );
    CREATE INDEX messages_by_conversation ON messages(conversation_id, id);
    """,
    "ALTER TABLE messages ADD COLUMN complete INTEGER NOT NULL DEFAULT 1;",
]
BUSY_TIMEOUT_S = 5.0  # how long a write waits for another process's lock before it gives up


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    created: float
    interrupted: bool = False
    stats: dict | None = None
    complete: bool = True  # False: the process ended while this reply was being written

    def for_template(self) -> dict:
        extra = (self.stats or {}).get("message", {})  # tool_calls of an assistant turn, a tool's name
        return {"role": self.role, "content": self.content, **extra}


@dataclass(frozen=True)
class Conversation:
    id: str
    created: float
    model: str | None
    system: str | None
    title: str | None
    messages: int = 0


class Store:
    def __init__(self, path: str | Path):
        from .paths import private_file

        self.path = Path(path)
        private_file(self.path)  # 0600 before sqlite makes it 0644 (its -wal and -shm take its mode)
        self.db = sqlite3.connect(str(self.path), check_same_thread=False, timeout=BUSY_TIMEOUT_S)
        # WAL: a commit appends to the log, readers never block the writer. NORMAL: no fsync per
        # commit; a process crash loses nothing committed (only a power cut can).
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self._migrate()

    def _migrate(self) -> None:
        done = self.db.execute("PRAGMA user_version").fetchone()[0]
        for i, sql in enumerate(MIGRATIONS[done:], start=done + 1):
            with self.db:
                self.db.executescript(sql)
                self.db.execute(f"PRAGMA user_version = {i}")

    def close(self) -> None:
        self.db.close()

    def _execute(self, sql: str, params: tuple = ()):
        # sqlite3 raises UnicodeEncodeError on a lone surrogate: store U+FFFD instead
        return self.db.execute(sql, tuple(scrub(v) if isinstance(v, str) else v for v in params))

    # -- writing -------------------------------------------------------------------------
    def new_conversation(self, model: str | None, system: str | None = None) -> str:
        cid = time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)
        with self.db:
            self._execute(
                "INSERT INTO conversations (id, created, model, system) VALUES (?, ?, ?, ?)",
                (cid, time.time(), model, system),
            )
        return cid

    def add_message(
        self,
        cid: str,
        role: str,
        content: str,
        *,
        interrupted: bool = False,
        stats: dict | None = None,
        complete: bool = True,
    ) -> int:
        """Insert a message; returns its row id (update_message changes a reply as it grows)."""
        with self.db:
            row = self._execute(
                "INSERT INTO messages (conversation_id, created, role, content, interrupted, stats, complete) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    cid,
                    time.time(),
                    role,
                    content,
                    int(interrupted),
                    json.dumps(stats) if stats else None,
                    int(complete),
                ),
            )
            if role == "user":
                self._execute(
                    "UPDATE conversations SET title = ? WHERE id = ? AND title IS NULL",
                    (content.strip().splitlines()[0][:80] if content.strip() else "", cid),
                )
        return row.lastrowid

    def update_message(
        self,
        mid: int,
        content: str,
        *,
        interrupted: bool | None = None,
        stats: dict | None = None,
        complete: bool | None = None,
    ) -> None:
        """A streaming reply's text so far; at its end, its final state."""
        sets, values = ["content = ?"], [content]
        for col, v in (("interrupted", interrupted), ("complete", complete)):
            if v is not None:
                sets.append(f"{col} = ?")
                values.append(int(v))
        if stats:
            sets.append("stats = ?")
            values.append(json.dumps(stats))
        with self.db:
            self._execute(f"UPDATE messages SET {', '.join(sets)} WHERE id = ?", (*values, mid))

    def delete_message(self, mid: int) -> None:
        with self.db:
            self._execute("DELETE FROM messages WHERE id = ?", (mid,))

    def delete_last(self, cid: str, role: str) -> None:
        """Remove the conversation's last message if it has this role."""
        with self.db:
            row = self._execute(
                "SELECT id, role FROM messages WHERE conversation_id = ? ORDER BY id DESC LIMIT 1", (cid,)
            ).fetchone()
            if row and row[1] == role:
                self._execute("DELETE FROM messages WHERE id = ?", (row[0],))

    def set_system(self, cid: str, system: str | None) -> None:
        with self.db:
            self._execute("UPDATE conversations SET system = ? WHERE id = ?", (system, cid))

    # -- reading -------------------------------------------------------------------------
    def get(self, cid: str) -> Conversation | None:
        row = self._execute(
            "SELECT c.id, c.created, c.model, c.system, c.title, COUNT(m.id) FROM conversations c "
            "LEFT JOIN messages m ON m.conversation_id = c.id WHERE c.id = ? GROUP BY c.id",
            (cid,),
        ).fetchone()
        return Conversation(*row) if row else None

    def latest(self) -> str | None:
        row = self._execute("SELECT id FROM conversations ORDER BY created DESC, rowid DESC LIMIT 1").fetchone()
        return row[0] if row else None

    def list(self, limit: int = 20) -> list[Conversation]:
        rows = self._execute(
            "SELECT c.id, c.created, c.model, c.system, c.title, COUNT(m.id) FROM conversations c "
            "LEFT JOIN messages m ON m.conversation_id = c.id GROUP BY c.id "
            "ORDER BY c.created DESC, c.rowid DESC LIMIT ?",
            (limit,),
        ).fetchall()
        return [Conversation(*r) for r in rows]

    def messages(self, cid: str) -> list[Message]:
        rows = self._execute(
            "SELECT role, content, created, interrupted, stats, complete FROM messages WHERE conversation_id = ? "
            "ORDER BY id",
            (cid,),
        ).fetchall()
        return [Message(r[0], r[1], r[2], bool(r[3]), json.loads(r[4]) if r[4] else None, bool(r[5])) for r in rows]


class StoreError(Exception):
    """The log database cannot be opened (locked, corrupt, unreadable): one line, exit 3."""


def open_store() -> Store:
    """The log database in the state folder (ConfigError when that folder is unusable)."""
    from .paths import ensure_home, logs_db

    ensure_home()
    path = logs_db()
    try:
        return Store(path)
    except (sqlite3.Error, OSError) as e:
        raise StoreError(f"{path}: {store_failure(e)}") from None


def store_failure(e: BaseException) -> str:
    """What went wrong with the database, in words (a lock says how long it was waited for)."""
    text = str(e) or type(e).__name__
    return f"{text}; waited {BUSY_TIMEOUT_S:g} s" if "locked" in text else text


def logging_disabled() -> bool:
    return os.environ.get("FLASHMOE_NO_LOG", "") not in ("", "0")
