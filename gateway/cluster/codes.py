"""Pairing codes, link codes and identity links in PostgreSQL (schema plus plain get/put;
the linking flow of gateway/linking.py does not use them yet)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from gateway.cluster.db import Pool


@dataclass(frozen=True)
class PairingCode:
    code: str
    platform: str
    user_id: str
    expires_at: datetime


@dataclass(frozen=True)
class LinkCode:
    code: str
    principal: str
    expires_at: datetime


async def put_pairing_code(pool: Pool, code: str, platform: str, user_id: str, ttl_s: float) -> None:
    async with pool.connection() as conn:
        await conn.execute(
            """INSERT INTO pairing_codes (code, platform, user_id, expires_at)
               VALUES (%s, %s, %s, now() + make_interval(secs => %s))
               ON CONFLICT (code) DO UPDATE SET platform = EXCLUDED.platform, user_id = EXCLUDED.user_id,
                   created_at = now(), expires_at = EXCLUDED.expires_at""",
            (code, platform, user_id, ttl_s),
        )


async def get_pairing_code(pool: Pool, code: str) -> PairingCode | None:
    """The code if it exists and has not expired."""
    async with pool.connection() as conn:
        r = await (
            await conn.execute(
                "SELECT code, platform, user_id, expires_at FROM pairing_codes WHERE code = %s AND expires_at > now()",
                (code,),
            )
        ).fetchone()
        return PairingCode(r["code"], r["platform"], r["user_id"], r["expires_at"]) if r else None


async def put_link_code(pool: Pool, code: str, principal: str, ttl_s: float) -> None:
    async with pool.connection() as conn:
        await conn.execute(
            """INSERT INTO link_codes (code, principal, expires_at) VALUES (%s, %s, now() + make_interval(secs => %s))
               ON CONFLICT (code) DO UPDATE SET principal = EXCLUDED.principal, created_at = now(),
                   expires_at = EXCLUDED.expires_at""",
            (code, principal, ttl_s),
        )


async def get_link_code(pool: Pool, code: str) -> LinkCode | None:
    """The code if it exists and has not expired."""
    async with pool.connection() as conn:
        r = await (
            await conn.execute(
                "SELECT code, principal, expires_at FROM link_codes WHERE code = %s AND expires_at > now()", (code,)
            )
        ).fetchone()
        return LinkCode(r["code"], r["principal"], r["expires_at"]) if r else None


async def put_identity_link(pool: Pool, principal: str, link_name: str) -> None:
    """Link `principal` ("platform:user_id") to the identity `link_name` (replacing an older link)."""
    async with pool.connection() as conn:
        await conn.execute(
            """INSERT INTO identity_links (principal, link_name) VALUES (%s, %s)
               ON CONFLICT (principal) DO UPDATE SET link_name = EXCLUDED.link_name, created_at = now()""",
            (principal, link_name),
        )


async def get_identity_link(pool: Pool, principal: str) -> str | None:
    async with pool.connection() as conn:
        r = await (
            await conn.execute("SELECT link_name FROM identity_links WHERE principal = %s", (principal,))
        ).fetchone()
        return r["link_name"] if r else None
