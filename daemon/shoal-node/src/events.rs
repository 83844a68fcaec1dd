//! The node's event log, as the admin page shows it: what changed in the cluster as
//! this node saw it (members joining and leaving, going down and coming back, leader
//! changes, models placed, re-placed, unplaced and unloaded, and every owner action with
//! the member it came through: the cluster state's audit log, security review F1), with
//! times. Derived from successive membership views by a pure diff ([`diff`]); kept in
//! memory, the newest [`KEEP`].

use crate::runtime;
use shoal_membership::node::View;
use shoal_membership::Version;
use shoal_net::NodeId;
use shoal_types::ModelPlacement;
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};

/// Events kept.
pub const KEEP: usize = 200;

/// One thing that happened.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Event {
    /// When this node saw it, Unix milliseconds.
    pub at_ms: u64,
    /// What kind: `join`, `leave`, `down`, `up`, `leader`, `placed`, `replaced`,
    /// `unplaced`, `unloaded`, `owner` (an owner's action, through the member named).
    pub kind: String,
    /// For people.
    pub text: String,
}

/// The log: shared between the watcher and the admin page.
#[derive(Clone, Default)]
pub struct Log(Arc<Mutex<VecDeque<Event>>>);

impl Log {
    /// The events, oldest first.
    pub fn list(&self) -> Vec<Event> {
        lock(&self.0).iter().cloned().collect()
    }

    fn push(&self, e: Event) {
        let mut q = lock(&self.0);
        if q.len() == KEEP {
            q.pop_front();
        }
        q.push_back(e);
    }
}

/// What [`diff`] compares: the parts of a view the log speaks of.
#[derive(Clone, Default, PartialEq)]
pub struct Seen {
    /// Members by id, with their names.
    members: BTreeMap<NodeId, String>,
    /// Members up.
    alive: Vec<NodeId>,
    /// The leader.
    leader: Option<NodeId>,
    /// Placements by model hash: generation, error, the model's name.
    placements: BTreeMap<String, (u64, Option<String>, String)>,
    /// The owner actions the state records: version, the member, the action.
    audit: Vec<(Version, NodeId, String)>,
    /// Catalog names by content hash (to tell actions on models by name).
    names: BTreeMap<String, String>,
}

impl Seen {
    /// The parts of `view` the log compares.
    pub fn of(view: &View) -> Seen {
        let Some(state) = &view.state else { return Seen::default() };
        let names: BTreeMap<String, String> =
            crate::models::entries(view).into_iter().map(|e| (e.content_hash, e.name)).collect();
        let placements = runtime::placements(view)
            .into_iter()
            .map(|(hash, p): (String, ModelPlacement)| {
                let name = names.get(&hash).cloned().unwrap_or_else(|| hash.chars().take(12).collect());
                (hash, (p.generation, p.error, name))
            })
            .collect();
        Seen {
            members: state.members.values().map(|m| (m.id, m.name.clone())).collect(),
            alive: view.alive.iter().copied().collect(),
            leader: view.leader,
            placements,
            audit: state.audit.iter().map(|a| (a.version, a.from, a.action.clone())).collect(),
            names,
        }
    }
}

/// The events between `before` and `after` (kind, text), in a fixed order.
pub fn diff(before: &Seen, after: &Seen) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    let name = |id: &NodeId| {
        after.members.get(id).or_else(|| before.members.get(id)).cloned().unwrap_or_else(|| id.to_string()[..8].into())
    };
    for (id, n) in &after.members {
        if !before.members.contains_key(id) && !before.members.is_empty() {
            out.push(("join", format!("{n} joined the cluster")));
        }
    }
    for id in before.members.keys() {
        if !after.members.contains_key(id) && !after.members.is_empty() {
            out.push(("leave", format!("{} left the cluster", name(id))));
        }
    }
    for id in after.members.keys() {
        let (was, is) = (before.alive.contains(id), after.alive.contains(id));
        if before.members.contains_key(id) && was && !is {
            out.push(("down", format!("{} is down", name(id))));
        }
        if before.members.contains_key(id) && !was && is {
            out.push(("up", format!("{} is back", name(id))));
        }
    }
    if after.leader != before.leader {
        if let Some(l) = &after.leader {
            out.push(("leader", format!("{} leads", name(l))));
        }
    }
    for (hash, (generation, error, model)) in &after.placements {
        match (before.placements.get(hash), error) {
            (None, None) => out.push(("placed", format!("{model} placed"))),
            (None, Some(e)) => out.push(("unplaced", format!("{model} cannot be placed: {e}"))),
            (Some((g, _, _)), None) if g != generation => out.push(("replaced", format!("{model} placed anew"))),
            (Some((g, _, _)), Some(e)) if g != generation => {
                out.push(("unplaced", format!("{model} cannot be placed: {e}")))
            }
            _ => {}
        }
    }
    // A node that left its cluster sees nothing at all: not a wave of unloads.
    for (hash, (_, _, model)) in before.placements.iter().filter(|_| !after.members.is_empty()) {
        if !after.placements.contains_key(hash) {
            out.push(("unloaded", format!("{model} unloaded")));
        }
    }
    // Owner actions new since: the first state a node adopts is not a flood of them.
    let last = before.audit.last().map(|a| a.0);
    for (version, from, action) in after.audit.iter().filter(|_| !before.members.is_empty()) {
        if last.is_none_or(|l| *version > l) {
            out.push(("owner", format!("{}: {}", name(from), owner_action(action, after))));
        }
    }
    out
}

/// An audit log's action text for people: known entries by what they are (the admin
/// password, an API key, a model by its name), anything else as recorded.
fn owner_action(action: &str, seen: &Seen) -> String {
    let model = |hash: &str| seen.names.get(hash).cloned().unwrap_or_else(|| hash.chars().take(12).collect());
    let (verb, key) = match action.split_once(' ') {
        Some((verb @ ("set" | "delete"), key)) => (verb == "set", key),
        _ => return action.to_string(),
    };
    if key == shoal_admin::AUTH_KEY {
        return "set the admin password".into();
    }
    if let Some(name) = key.strip_prefix(shoal_types::ApiKey::KEY_PREFIX) {
        return format!("{} the API key {name}", if verb { "made" } else { "revoked" });
    }
    if let Some(hash) = key.strip_prefix(shoal_types::CatalogEntry::KEY_PREFIX) {
        return format!(
            "{} {} {} the catalog",
            if verb { "added" } else { "removed" },
            model(hash),
            if verb { "to" } else { "from" }
        );
    }
    if let Some(hash) = key.strip_prefix(shoal_types::LoadSpec::KEY_PREFIX) {
        return format!("{} {}", if verb { "loaded" } else { "unloaded" }, model(hash));
    }
    if let Some((_, hash)) = key.strip_prefix(shoal_types::Speed::KEY_PREFIX).and_then(|r| r.split_once('/')) {
        return format!("{} a measured speed on {}", if verb { "set" } else { "forgot" }, model(hash));
    }
    if let Some(hash) = key.strip_prefix(crate::runtime::PROFILE_PREFIX).filter(|h| !h.contains('/')) {
        return format!("{} the description of {}", if verb { "stored" } else { "removed" }, model(hash));
    }
    if let Some(setting) = key.strip_prefix("settings/") {
        return format!("{} the setting {setting}", if verb { "changed" } else { "reset" });
    }
    action.to_string()
}

/// Watch this node's view and log what changes, until the node stops.
pub async fn watch(mut view: tokio::sync::watch::Receiver<View>, log: Log) {
    let mut seen = Seen::of(&view.borrow_and_update());
    while view.changed().await.is_ok() {
        let now = Seen::of(&view.borrow_and_update());
        if now == seen {
            continue;
        }
        let at_ms =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        for (kind, text) in diff(&seen, &now) {
            tracing::info!(kind, "{text}");
            log.push(Event { at_ms, kind: kind.into(), text });
        }
        seen = now;
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Single pushes and copies: a panic leaves the queue whole.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(b: u8) -> NodeId {
        NodeId([b; 32])
    }

    fn seen(
        members: &[(u8, &str)],
        alive: &[u8],
        leader: Option<u8>,
        placements: &[(&str, u64, Option<&str>)],
    ) -> Seen {
        Seen {
            members: members.iter().map(|(b, n)| (id(*b), n.to_string())).collect(),
            alive: alive.iter().map(|b| id(*b)).collect(),
            leader: leader.map(id),
            placements: placements
                .iter()
                .map(|(h, g, e)| (h.to_string(), (*g, e.map(str::to_string), format!("m-{h}"))))
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn owner_actions_are_told_once_with_the_member_they_came_through() {
        let a = seen(&[(1, "alpha"), (2, "beta")], &[1, 2], Some(1), &[]);
        let v = |index| Version { term: 3, index };
        let mut b = a.clone();
        b.names.insert("h".repeat(64), "smollm".into());
        b.audit = vec![
            (v(5), id(2), "set admin/auth".into()),
            (v(6), id(1), format!("set catalog/{}", "h".repeat(64))),
            (v(7), id(2), "set apikey/webui".into()),
            (v(8), id(2), "delete load/abc".into()),
            (v(9), id(1), "approve gamma (0303)".into()),
        ];
        let texts: Vec<_> = diff(&a, &b).into_iter().map(|(k, t)| format!("{k}: {t}")).collect();
        assert_eq!(
            texts,
            [
                "owner: beta: set the admin password",
                "owner: alpha: added smollm to the catalog",
                "owner: beta: made the API key webui",
                "owner: beta: unloaded abc",
                "owner: alpha: approve gamma (0303)",
            ]
        );
        // Seen ones are not told again; a new one is.
        let mut c = b.clone();
        c.audit.push((v(10), id(2), "set settings/api_open".into()));
        let texts: Vec<_> = diff(&b, &c).into_iter().map(|(_, t)| t).collect();
        assert_eq!(texts, ["beta: changed the setting api_open"]);
        // A fresh node's first state is not a flood of old actions.
        assert!(diff(&Seen::default(), &c).iter().all(|(k, _)| *k != "owner"));
    }

    #[test]
    fn joins_leaves_downs_leaders_and_placements_are_told_apart() {
        let a = seen(&[(1, "alpha"), (2, "beta")], &[1, 2], Some(1), &[("h", 1, None)]);
        assert!(diff(&a, &a).is_empty());
        let b = seen(
            &[(1, "alpha"), (2, "beta"), (3, "gamma")],
            &[1, 3],
            Some(3),
            &[("h", 2, None), ("k", 1, Some("too big"))],
        );
        let kinds: Vec<_> = diff(&a, &b).into_iter().map(|(k, t)| format!("{k}: {t}")).collect();
        assert_eq!(
            kinds,
            [
                "join: gamma joined the cluster",
                "down: beta is down",
                "leader: gamma leads",
                "replaced: m-h placed anew",
                "unplaced: m-k cannot be placed: too big"
            ]
        );
        let c = seen(&[(1, "alpha"), (3, "gamma")], &[1, 3], Some(3), &[]);
        let kinds: Vec<_> = diff(&b, &c).into_iter().map(|(k, _)| k).collect();
        assert_eq!(kinds, ["leave", "unloaded", "unloaded"]);
        // A node that left (or reset) sees nothing: not a wave of leaves and unloads.
        assert!(diff(&a, &Seen::default()).is_empty());
        // The first state a fresh node adopts is not a flood of joins.
        let kinds: Vec<_> = diff(&Seen::default(), &a).into_iter().map(|(k, _)| k).collect();
        assert_eq!(kinds, ["leader", "placed"]);
    }
}
