//! Caller buffers through Python's buffer protocol (numpy arrays, bytearray, memoryview, bytes,
//! CPU torch tensors through a uint8 view).
//!
//! pyo3's `PyBuffer` is compiled only for the stable ABI of CPython 3.11 and later (when
//! `Py_buffer` joined the limited API); this wheel targets 3.9. The two functions and the
//! struct below have had this exact form in every CPython 3 since 3.3 (the limited API froze
//! that form in 3.11), and every CPython exports the functions, so the extension declares them
//! itself.

use std::ffi::{c_char, c_int, c_void};

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi::{Py_ssize_t, PyObject};
use pyo3::prelude::*;

/// `Py_buffer`, as in CPython's `Include/pybuffer.h`.
#[repr(C)]
struct RawBuffer {
    buf: *mut c_void,
    obj: *mut PyObject,
    len: Py_ssize_t,
    itemsize: Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut Py_ssize_t,
    strides: *mut Py_ssize_t,
    suboffsets: *mut Py_ssize_t,
    internal: *mut c_void,
}

/// `PyBUF_STRIDES | PyBUF_FORMAT` (`PyBUF_RECORDS_RO`): any layout, read-only allowed; this
/// module checks writability and contiguity itself so it can say which argument is wrong.
const PYBUF_RECORDS_RO: c_int = 0x0010 | 0x0008 | 0x0004;

unsafe extern "C" {
    fn PyObject_GetBuffer(obj: *mut PyObject, view: *mut RawBuffer, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut RawBuffer);
}

/// A buffer held from a Python object; released (with the GIL) when dropped.
pub struct HeldBuffer {
    // Boxed: the exporter may keep pointers into the view until release.
    view: Box<RawBuffer>,
    // The view holds its own reference to the exporter; this keeps the object we asked (a
    // torch tensor's uint8 view may be a temporary) alive as well.
    _owner: Py<PyAny>,
}

// SAFETY: a HeldBuffer is only created and dropped while attached to the interpreter (every
// constructor takes a `Python` token and `Drop` re-attaches); the raw pointers it holds are to
// memory the exporter keeps alive until `PyBuffer_Release`.
unsafe impl Send for HeldBuffer {}

impl Drop for HeldBuffer {
    fn drop(&mut self) {
        Python::attach(|_py| {
            // SAFETY: the view was filled by a successful PyObject_GetBuffer and is released
            // exactly once, here, while attached.
            unsafe { PyBuffer_Release(&mut *self.view) };
        });
    }
}

/// What the caller's buffer will be used for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Read from (a put): read-only buffers are fine.
    Read,
    /// Written into (a get): must be writable.
    Write,
}

impl HeldBuffer {
    /// Holds `obj`'s buffer, which must be C-contiguous (and writable for [`Access::Write`]).
    /// `what` names the argument in errors ("buffer 3").
    pub fn new(obj: &Bound<'_, PyAny>, access: Access, what: &str) -> PyResult<HeldBuffer> {
        let obj = torch_as_bytes(obj, what)?.unwrap_or_else(|| obj.clone());
        let mut view = Box::new(RawBuffer {
            buf: std::ptr::null_mut(),
            obj: std::ptr::null_mut(),
            len: 0,
            itemsize: 0,
            readonly: 0,
            ndim: 0,
            format: std::ptr::null_mut(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            suboffsets: std::ptr::null_mut(),
            internal: std::ptr::null_mut(),
        });
        // SAFETY: `obj` is a live object (we hold a reference and are attached); `view` is a
        // zeroed, heap-pinned Py_buffer for the exporter to fill.
        let rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *view, PYBUF_RECORDS_RO) };
        if rc != 0 {
            let cause = PyErr::take(obj.py())
                .map(|e| e.to_string())
                .unwrap_or_default();
            return Err(PyTypeError::new_err(format!(
                "{what}: a {} does not export a buffer (expected bytes, bytearray, memoryview, \
                 a numpy array or a CPU torch tensor): {cause}",
                type_name(&obj)
            )));
        }
        let held = HeldBuffer {
            view,
            _owner: obj.clone().unbind(),
        };
        if access == Access::Write && held.view.readonly != 0 {
            return Err(PyValueError::new_err(format!(
                "{what}: the {} is read-only; pass a writable buffer (bytearray, a numpy array, ...)",
                type_name(&obj)
            )));
        }
        if !held.is_c_contiguous() {
            return Err(PyValueError::new_err(format!(
                "{what}: the {} is not C-contiguous; pass a contiguous one (numpy: \
                 np.ascontiguousarray, torch: .contiguous()) or a contiguous slice",
                type_name(&obj)
            )));
        }
        Ok(held)
    }

    pub fn len(&self) -> usize {
        // A successful export never reports a negative length.
        self.view.len.max(0) as usize
    }

    fn is_c_contiguous(&self) -> bool {
        let v = &*self.view;
        if !v.suboffsets.is_null() {
            return false;
        }
        if v.strides.is_null() || v.ndim <= 0 || v.len == 0 {
            return true;
        }
        let n = v.ndim as usize;
        // SAFETY: with PyBUF_STRIDES the exporter filled `ndim` entries of shape and strides,
        // valid until release.
        let (shape, strides) = unsafe {
            (
                std::slice::from_raw_parts(v.shape, n),
                std::slice::from_raw_parts(v.strides, n),
            )
        };
        let mut expected = v.itemsize;
        for d in (0..n).rev() {
            if shape[d] > 1 && strides[d] != expected {
                return false;
            }
            expected *= shape[d];
        }
        true
    }

    /// The bytes, for reading.
    pub fn as_slice(&self) -> &[u8] {
        if self.len() == 0 {
            return &[];
        }
        // SAFETY: a C-contiguous export of `len` bytes at `buf`, alive until release (which
        // needs `&mut self`, so not while this borrow lives). Python code running in other
        // threads while the GIL is released could write it: the API docs tell callers not to
        // touch a buffer during the call that uses it.
        unsafe { std::slice::from_raw_parts(self.view.buf as *const u8, self.len()) }
    }

    /// The bytes, for writing. Only for buffers held with [`Access::Write`]; callers must not
    /// hand out two overlapping ones (see [`check_disjoint`]).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.len() == 0 {
            return &mut [];
        }
        debug_assert_eq!(self.view.readonly, 0);
        // SAFETY: as `as_slice`, and the export is writable (checked in `new`); `&mut self`
        // keeps this the only slice of this view, and `check_disjoint` keeps different views
        // of the same memory from being written at once.
        unsafe { std::slice::from_raw_parts_mut(self.view.buf as *mut u8, self.len()) }
    }

    pub(crate) fn range(&self) -> (usize, usize) {
        let start = self.view.buf as usize;
        (start, start + self.len())
    }
}

/// Refuses buffers that overlap (the same bytearray twice, two views of one array): they
/// would be written at once.
pub fn check_disjoint(bufs: &[HeldBuffer]) -> PyResult<()> {
    let mut ranges: Vec<(usize, usize, usize)> = bufs
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let (s, e) = b.range();
            (s, e, i)
        })
        .filter(|(s, e, _)| e > s)
        .collect();
    ranges.sort_unstable();
    for w in ranges.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(PyValueError::new_err(format!(
                "buffers {} and {} overlap; each block needs its own memory",
                w[0].2.min(w[1].2),
                w[0].2.max(w[1].2)
            )));
        }
    }
    Ok(())
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "object".into())
}

/// A torch tensor has no buffer protocol: a contiguous CPU tensor is viewed as uint8 bytes
/// through numpy (no copy). Anything else torch-like is refused with the reason.
fn torch_as_bytes<'py>(obj: &Bound<'py, PyAny>, what: &str) -> PyResult<Option<Bound<'py, PyAny>>> {
    let ty = obj.get_type();
    let module = ty
        .getattr("__module__")
        .and_then(|m| m.extract::<String>())
        .unwrap_or_default();
    if !(module == "torch" || module.starts_with("torch.")) || !obj.hasattr("data_ptr")? {
        return Ok(None);
    }
    let device = obj
        .getattr("device")?
        .getattr("type")?
        .extract::<String>()?;
    if device != "cpu" {
        return Err(PyValueError::new_err(format!(
            "{what}: a torch tensor on {device}; kvtier reads and writes host memory (copy \
             through a pinned CPU tensor)"
        )));
    }
    if !obj.call_method0("is_contiguous")?.extract::<bool>()? {
        return Err(PyValueError::new_err(format!(
            "{what}: the torch tensor is not contiguous; pass tensor.contiguous() (a copy) \
             or a contiguous slice"
        )));
    }
    let torch = obj.py().import("torch")?;
    let flat = obj.call_method0("detach")?.call_method1("reshape", (-1,))?;
    let bytes = flat.call_method1("view", (torch.getattr("uint8")?,))?;
    Ok(Some(bytes.call_method0("numpy")?))
}
