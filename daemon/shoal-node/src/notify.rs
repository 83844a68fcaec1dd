//! What the node tells its service manager: systemd's `sd_notify` protocol on Unix
//! (ready with a status line, stopping, watchdog pings; a lab waiting on
//! `NOTIFY_SOCKET` reads the same). Elsewhere these do nothing: Windows' Service Control
//! Manager hears from `shoal-service` instead. Without `NOTIFY_SOCKET` set, nothing is
//! sent; a failure to tell is never worth stopping for.

use std::time::Duration;

/// The node serves: `status` is the line `systemctl status` shows.
pub fn ready(status: &str) {
    #[cfg(unix)]
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready, sd_notify::NotifyState::Status(status)]);
    #[cfg(not(unix))]
    let _ = status;
}

/// The node is stopping.
pub fn stopping() {
    #[cfg(unix)]
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Stopping]);
}

/// The node is alive (systemd's watchdog).
pub fn watchdog() {
    #[cfg(unix)]
    let _ = sd_notify::notify(&[sd_notify::NotifyState::Watchdog]);
}

/// The watchdog's period, when the service manager set one (`WatchdogSec=`).
pub fn watchdog_period() -> Option<Duration> {
    #[cfg(unix)]
    return sd_notify::watchdog_enabled();
    #[cfg(not(unix))]
    return None;
}
