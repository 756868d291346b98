"""The one websocket consumer: subscribe to topics, get their cards now and on every change."""
from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer

from console import live, live_sessions, roles

MAX_TOPICS = 20


class LiveConsumer(AsyncWebsocketConsumer):
    async def connect(self):
        user = self.scope.get("user")
        if not (user and user.is_authenticated):
            await self.close(code=live_sessions.SESSION_ENDED)
            return
        # Every topic is checked before the socket joins any group: a refused one subscribes to nothing.
        topics = self._topics_asked()
        # The cards come rendered for the user's role: its buttons say what that role may press.
        role = await database_sync_to_async(roles.role_of)(user)
        allowed = role is not None and topics and await database_sync_to_async(lambda: all(live.may_see(user, t) for t in topics))()
        if not allowed:
            await self.close(code=4403)
            return
        self.topics = topics
        await self.join_own_groups(user)
        self.groups = [live.group_name(topic, role) for topic in self.topics]
        for group in self.groups:
            await self.channel_layer.group_add(group, self.channel_name)
        await self.accept()
        # Subscribe first, then render: a change between page load and now is not lost.
        for topic in self.topics:
            for html in await database_sync_to_async(live.render_topic)(topic, "", role):
                await self.send(text_data=html)

    def _topics_asked(self) -> list[str]:
        """The topics in the query string; none at all when one is unknown or malformed (``machine:abc``)
        or more than MAX_TOPICS are asked for, so that a refused socket subscribes to nothing."""
        query = parse_qs(self.scope.get("query_string", b"").decode(errors="replace"))
        topics = query.get("topic", [])
        if len(topics) > MAX_TOPICS or not all(live.parse_topic(topic) for topic in topics):
            return []
        return topics

    async def join_own_groups(self, user) -> None:
        """Join the user's and the session's groups: the socket closes when they end (console/live_sessions.py)."""
        session = self.scope.get("session")
        self.own_groups = live_sessions.socket_groups(user, session.session_key if session else None)
        for group in self.own_groups:
            await self.channel_layer.group_add(group, self.channel_name)

    async def disconnect(self, code):
        await self.leave_groups()

    async def leave_groups(self) -> None:
        groups = getattr(self, "groups", []) + getattr(self, "own_groups", [])
        self.groups, self.own_groups = [], []
        for group in groups:
            await self.channel_layer.group_discard(group, self.channel_name)

    async def live_html(self, event):
        await self.send(text_data=event["html"])

    async def live_close(self, event):
        """The session that opened this socket ended (logout, new password, account deactivated: 4401),
        or the user's role changed (4000: the page reconnects). See console/live_sessions.py.

        The groups are left first: no card reaches the socket while the server takes it down."""
        await self.leave_groups()
        await self.close(code=event.get("code", live_sessions.SESSION_ENDED))
