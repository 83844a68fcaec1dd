//! Windows: the node as a service of the Service Control Manager (the `windows-service`
//! crate). `install` puts the binary in `%ProgramFiles%\Shoal`, creates the service
//! (automatic start, restarted on failure, running `shoal serve --windows-service`
//! with data in `%ProgramData%\Shoal`), opens Shoal's ports in the firewall for private
//! networks only, and starts it; `uninstall` undoes that. [`run_as_service`] is what
//! the service process runs: it reports to the SCM and turns its stop request into the
//! node's shutdown. The .msi (`packaging/windows`) installs the same service.

use crate::{copy_atomic, remove_file, write_atomic, InstallOptions, ServiceError, UninstallOptions};
use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::mpsc;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use windows_service::service::{
    ServiceAccess, ServiceAction, ServiceActionType, ServiceControl, ServiceControlAccept, ServiceErrorControl,
    ServiceExitCode, ServiceFailureActions, ServiceFailureResetPeriod, ServiceInfo, ServiceStartType, ServiceState,
    ServiceStatus, ServiceType,
};
use windows_service::service_control_handler::{self, ServiceControlHandlerResult};
use windows_service::service_manager::{ServiceManager, ServiceManagerAccess};
use windows_service::{define_windows_service, service_dispatcher};

/// The service's name in the SCM.
pub const SERVICE_NAME: &str = "Shoal";
/// Firewall rules, by name: (name, protocol, local port). The same names as the
/// installer's (`packaging/windows/main.wxs`), so either way of uninstalling removes them.
const FIREWALL: [(&str, &str, &str); 4] = [
    ("Shoal cluster (QUIC)", "UDP", "47070"),
    ("Shoal join (QUIC)", "UDP", "47071"),
    ("Shoal discovery (mDNS)", "UDP", "5353"),
    ("Shoal API (HTTP)", "TCP", "11434"),
];

/// The service's data directory where `%ProgramData%` is the usual `C:\ProgramData`
/// (see [`data_dir`]).
pub const DATA_DIR: &str = r"C:\ProgramData\Shoal";

/// `%ProgramData%\Shoal`: the service's data (key, cluster state, models).
pub fn data_dir() -> PathBuf {
    PathBuf::from(std::env::var_os("ProgramData").unwrap_or_else(|| OsString::from(r"C:\ProgramData"))).join("Shoal")
}

/// `%ProgramFiles%\Shoal\shoal.exe`: where the service's binary is installed.
pub fn bin_path() -> PathBuf {
    PathBuf::from(std::env::var_os("ProgramFiles").unwrap_or_else(|| OsString::from(r"C:\Program Files")))
        .join("Shoal")
        .join("shoal.exe")
}

fn scm(e: windows_service::Error) -> ServiceError {
    let text = e.to_string();
    if text.contains("Access is denied") || text.contains("os error 5") {
        ServiceError::NotAdmin("installing a service needs an administrator's terminal".into())
    } else {
        ServiceError::Manager(text)
    }
}

/// Install, open the firewall and start; what was done, a line each. With a root
/// directory only the files are written there.
pub fn install(o: &InstallOptions) -> Result<Vec<String>, ServiceError> {
    let mut done = Vec::new();
    let rooted = |p: PathBuf| match &o.root {
        // Drop the drive prefix: C:\Program Files\Shoal → <root>\Program Files\Shoal.
        Some(root) => root.join(p.components().skip(2).collect::<PathBuf>()),
        None => p,
    };
    let bin = rooted(bin_path());
    if o.root.is_none() {
        // A running service holds its binary open: stop it before replacing it.
        stop_service()?;
    }
    if !same_file(&o.exe, &bin) {
        copy_atomic(&o.exe, &bin, 0o755)?;
        done.push(format!("installed {}", bin.display()));
    }
    let data = rooted(data_dir());
    std::fs::create_dir_all(&data).map_err(crate::io(&data))?;
    if o.root.is_none() {
        // The node's key is its owner's credential (the CLI speaks with it): only the
        // service (LocalSystem) and administrators may read it. ProgramData's own access
        // list would let every user read it.
        crate::run(
            "icacls",
            &[&data.to_string_lossy(), "/inheritance:r", "/grant:r", "*S-1-5-18:(OI)(CI)F", "*S-1-5-32-544:(OI)(CI)F"],
        )?;
        done.push(format!("{} readable by SYSTEM and Administrators only", data.display()));
    }
    if let Some(token) = &o.join_token {
        let file = data.join(crate::JOIN_TOKEN_FILE);
        write_atomic(&file, format!("{token}\n").as_bytes(), 0o600)?;
        done.push(format!("the node joins with the token in {}", file.display()));
    }
    if o.root.is_some() {
        return Ok(done);
    }

    let manager = ServiceManager::local_computer(
        None::<&str>,
        ServiceManagerAccess::CONNECT | ServiceManagerAccess::CREATE_SERVICE,
    )
    .map_err(scm)?;
    let info = ServiceInfo {
        name: OsString::from(SERVICE_NAME),
        display_name: OsString::from("Shoal node"),
        service_type: ServiceType::OWN_PROCESS,
        start_type: ServiceStartType::AutoStart,
        error_control: ServiceErrorControl::Normal,
        executable_path: bin.clone(),
        launch_arguments: vec![
            OsString::from("serve"),
            OsString::from("--data-dir"),
            data.clone().into_os_string(),
            OsString::from("--windows-service"),
        ],
        dependencies: vec![],
        // LocalSystem: the data directory under ProgramData is its own.
        account_name: None,
        account_password: None,
    };
    let access = ServiceAccess::QUERY_STATUS | ServiceAccess::START | ServiceAccess::CHANGE_CONFIG;
    let service = match manager.create_service(&info, access) {
        Ok(s) => {
            done.push(format!("created the service {SERVICE_NAME}"));
            s
        }
        // An earlier install: bring its definition up to date.
        Err(_) => {
            let s = manager.open_service(SERVICE_NAME, access).map_err(scm)?;
            s.change_config(&info).map_err(scm)?;
            s
        }
    };
    service.set_description("This machine's share of a pooled LLM cluster").map_err(scm)?;
    let restart = ServiceAction { action_type: ServiceActionType::Restart, delay: Duration::from_secs(2) };
    service
        .update_failure_actions(ServiceFailureActions {
            reset_period: ServiceFailureResetPeriod::After(Duration::from_secs(24 * 3600)),
            reboot_msg: None,
            command: None,
            actions: Some(vec![restart.clone(), restart.clone(), restart]),
        })
        .map_err(scm)?;
    service.set_failure_actions_on_non_crash_failures(true).map_err(scm)?;
    for (name, protocol, ports) in FIREWALL {
        // The same rule twice would be two rules: delete first (absent is fine).
        let _ = crate::run("netsh", &["advfirewall", "firewall", "delete", "rule", &format!("name={name}")]);
        crate::run(
            "netsh",
            &[
                "advfirewall",
                "firewall",
                "add",
                "rule",
                &format!("name={name}"),
                "dir=in",
                "action=allow",
                &format!("protocol={protocol}"),
                &format!("localport={ports}"),
                "profile=private",
                &format!("program={}", bin.display()),
            ],
        )?;
    }
    done.push("opened UDP 47070-47071 and 5353, TCP 11434 for private networks".into());
    if service.query_status().map_err(scm)?.current_state != ServiceState::Running {
        service.start::<&str>(&[]).map_err(scm)?;
    }
    done.push(format!("the service {SERVICE_NAME} runs and starts at boot (data in {})", data.display()));
    Ok(done)
}

/// Whether two paths name the same file (`canonicalize` on Windows adds `\\?\`).
fn same_file(a: &std::path::Path, b: &std::path::Path) -> bool {
    let plain = |p: &std::path::Path| {
        let p = std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
        p.to_string_lossy().trim_start_matches(r"\\?\").to_lowercase()
    };
    plain(a) == plain(b)
}

/// Stop the service if it is installed and running, waiting up to 15 s.
fn stop_service() -> Result<(), ServiceError> {
    let manager = ServiceManager::local_computer(None::<&str>, ServiceManagerAccess::CONNECT).map_err(scm)?;
    let Ok(service) = manager.open_service(SERVICE_NAME, ServiceAccess::QUERY_STATUS | ServiceAccess::STOP) else {
        return Ok(());
    };
    if service.query_status().map_err(scm)?.current_state == ServiceState::Stopped {
        return Ok(());
    }
    let _ = service.stop();
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(15)
        && service.query_status().map_err(scm)?.current_state != ServiceState::Stopped
    {
        std::thread::sleep(Duration::from_millis(200));
    }
    Ok(())
}

/// Stop and delete the service, close the firewall (and, purging, delete the data).
pub fn uninstall(o: &UninstallOptions) -> Result<Vec<String>, ServiceError> {
    let mut done = Vec::new();
    if o.root.is_none() {
        let manager = ServiceManager::local_computer(None::<&str>, ServiceManagerAccess::CONNECT).map_err(scm)?;
        stop_service()?;
        if let Ok(service) = manager.open_service(SERVICE_NAME, ServiceAccess::DELETE) {
            service.delete().map_err(scm)?;
            done.push(format!("deleted the service {SERVICE_NAME}"));
        }
        for (name, _, _) in FIREWALL {
            let _ = crate::run("netsh", &["advfirewall", "firewall", "delete", "rule", &format!("name={name}")]);
        }
    }
    let rooted = |p: PathBuf| match &o.root {
        Some(root) => root.join(p.components().skip(2).collect::<PathBuf>()),
        None => p,
    };
    let bin = rooted(bin_path());
    let running_it = std::env::current_exe().is_ok_and(|me| same_file(&me, &bin));
    if running_it {
        // Windows does not delete a running program's file.
        done.push(format!("{} is this program: delete it once it has exited", bin.display()));
    } else if remove_file(&bin)? {
        done.push(format!("removed {}", bin.display()));
    }
    let data = rooted(data_dir());
    crate::purge_or_keep(&data, o.purge, &mut done)?;
    Ok(done)
}

/// The service's state; 0 when it runs, 3 when it does not, 4 when it is not installed
/// (systemctl's codes).
pub fn status() -> Result<i32, ServiceError> {
    let manager = ServiceManager::local_computer(None::<&str>, ServiceManagerAccess::CONNECT).map_err(scm)?;
    let Ok(service) = manager.open_service(SERVICE_NAME, ServiceAccess::QUERY_STATUS) else {
        println!("the service {SERVICE_NAME} is not installed");
        return Ok(4);
    };
    let state = service.query_status().map_err(scm)?.current_state;
    println!("the service {SERVICE_NAME} is {state:?}");
    Ok(if state == ServiceState::Running { 0 } else { 3 })
}

/// What the service runs: the node, until the receiver gets the SCM's stop.
pub type Serve = Box<dyn FnOnce(mpsc::Receiver<()>) -> Result<(), String> + Send>;

/// The node the dispatcher's thread runs (set once by [`run_as_service`]).
static SERVE: Mutex<Option<Serve>> = Mutex::new(None);

define_windows_service!(ffi_service_main, service_main);

/// Run `serve` as the SCM's service: blocks until the service stops. Started by the SCM
/// only (`shoal serve --windows-service`); from a terminal it fails at once.
pub fn run_as_service(serve: Serve) -> Result<(), ServiceError> {
    *SERVE.lock().unwrap_or_else(|p| p.into_inner()) = Some(serve);
    service_dispatcher::start(SERVICE_NAME, ffi_service_main).map_err(|e| {
        ServiceError::Manager(format!("{e} (--windows-service is for the Service Control Manager to start)"))
    })
}

fn service_main(_: Vec<OsString>) {
    let Some(serve) = SERVE.lock().unwrap_or_else(|p| p.into_inner()).take() else { return };
    let (stop_tx, stop_rx) = mpsc::channel();
    let handler = move |event| match event {
        ServiceControl::Stop | ServiceControl::Shutdown => {
            let _ = stop_tx.send(());
            ServiceControlHandlerResult::NoError
        }
        ServiceControl::Interrogate => ServiceControlHandlerResult::NoError,
        _ => ServiceControlHandlerResult::NotImplemented,
    };
    let Ok(handle) = service_control_handler::register(SERVICE_NAME, handler) else { return };
    let status = |state, exit: u32, wait: Duration| ServiceStatus {
        service_type: ServiceType::OWN_PROCESS,
        current_state: state,
        controls_accepted: if state == ServiceState::Running {
            ServiceControlAccept::STOP | ServiceControlAccept::SHUTDOWN
        } else {
            ServiceControlAccept::empty()
        },
        exit_code: ServiceExitCode::Win32(exit),
        checkpoint: 0,
        wait_hint: wait,
        process_id: None,
    };
    let _ = handle.set_service_status(status(ServiceState::Running, 0, Duration::ZERO));
    let result = serve(stop_rx);
    // A failure exits non-zero, so the SCM's recovery restarts the service.
    let code = if result.is_ok() { 0 } else { 1 };
    let _ = handle.set_service_status(status(ServiceState::Stopped, code, Duration::ZERO));
}
