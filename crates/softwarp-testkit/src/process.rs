//! Children that are killed and reaped when the test ends, also when it panics: a server
//! left running holds its port and, over many runs, the machine.

use std::process::{Child, Command};

/// A child killed and reaped on drop: its whole process group when it leads one (spawned with
/// `process_group(0)`: a tracer and what it traces), else the child alone.
#[derive(Debug)]
pub struct Reaped(Option<Child>);

impl Reaped {
    pub fn new(child: Child) -> Self {
        Self(Some(child))
    }

    /// Spawns `command`; panics naming `what` when it cannot be started.
    pub fn spawn(command: &mut Command, what: &str) -> Self {
        match command.spawn() {
            Ok(child) => Self::new(child),
            Err(e) => panic!("cannot start {what}: {e}"),
        }
    }

    /// The child, no longer killed on drop (to wait for its own end).
    pub fn take(mut self) -> Child {
        self.0.take().expect("a child is taken once")
    }
}

impl std::ops::Deref for Reaped {
    type Target = Child;
    fn deref(&self) -> &Child {
        self.0.as_ref().expect("a child is taken once")
    }
}

impl std::ops::DerefMut for Reaped {
    fn deref_mut(&mut self) -> &mut Child {
        self.0.as_mut().expect("a child is taken once")
    }
}

impl Drop for Reaped {
    fn drop(&mut self) {
        let Some(mut child) = self.0.take() else {
            return;
        };
        // Only a child not yet waited for still owns its pid (a zombie keeps it until it is
        // reaped); the pid of one the test already waited for may belong to another process
        // by now, so it is left alone.
        if let Ok(None) = child.try_wait() {
            if leads_its_group(child.id()) {
                if let Some(p) = rustix::process::Pid::from_raw(child.id() as i32) {
                    let _ = rustix::process::kill_process_group(p, rustix::process::Signal::KILL);
                }
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// True when process `pid` (not yet reaped) is the leader of its process group (the fifth
/// field of `/proc/PID/stat`, counted after the command name in parentheses).
fn leads_its_group(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let group = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(2).map(str::to_string));
    group.as_deref() == Some(pid.to_string().as_str())
}

/// `Command::spawn` into a [`Reaped`].
pub trait SpawnReaped {
    /// Spawns the command (panics, naming it, when it cannot be started).
    fn spawn_reaped(&mut self) -> Reaped;
}

impl SpawnReaped for Command {
    fn spawn_reaped(&mut self) -> Reaped {
        match self.spawn() {
            Ok(child) => Reaped::new(child),
            Err(e) => panic!("cannot start {:?}: {e}", self.get_program()),
        }
    }
}
