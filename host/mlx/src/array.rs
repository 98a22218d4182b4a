//! `Array`: an owned handle to a (possibly lazy) MLX array, and its elementwise, shape and
//! reduction methods. Arrays are not `Send`: MLX binds a lazy graph to the thread's default
//! stream, so all arrays of one model live on one thread (the engine thread). The one
//! exception is `Detached` (`async_eval_detached`): a started array's private copy, which
//! another thread may wait for and read.

use crate::ffi::ffi;
use crate::{Dtype, Error, Result};
use cxx::UniquePtr;

/// An MLX array. Cloning is cheap (MLX arrays are reference-counted).
pub struct Array(pub(crate) UniquePtr<ffi::array>);

impl Clone for Array {
    fn clone(&self) -> Self {
        Array(ffi::clone(&self.0))
    }
}

impl std::fmt::Debug for Array {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Array({:?}, {})", self.shape(), self.dtype())
    }
}

pub(crate) fn wrap(p: std::result::Result<UniquePtr<ffi::array>, cxx::Exception>) -> Result<Array> {
    Ok(Array(p?))
}

fn to_i32_dims(shape: &[usize]) -> Result<Vec<i32>> {
    shape
        .iter()
        .map(|&d| i32::try_from(d).map_err(|_| Error::Invalid(format!("dimension {d} does not fit in i32"))))
        .collect()
}

impl Array {
    /// A float32 array from host data; `data.len()` must equal the product of `shape`.
    pub fn from_f32(data: &[f32], shape: &[usize]) -> Result<Array> {
        wrap(ffi::from_f32(data, &to_i32_dims(shape)?))
    }
    /// An int32 array from host data.
    pub fn from_i32(data: &[i32], shape: &[usize]) -> Result<Array> {
        wrap(ffi::from_i32(data, &to_i32_dims(shape)?))
    }
    /// A uint32 array from host data.
    pub fn from_u32(data: &[u32], shape: &[usize]) -> Result<Array> {
        wrap(ffi::from_u32(data, &to_i32_dims(shape)?))
    }
    /// A 0-d array holding `v` as `dtype`.
    pub fn scalar(v: f32, dtype: Dtype) -> Result<Array> {
        wrap(ffi::scalar_f32(v, dtype as u8))
    }
    pub fn zeros(shape: &[usize], dtype: Dtype) -> Result<Array> {
        wrap(ffi::zeros(&to_i32_dims(shape)?, dtype as u8))
    }
    /// An array whose values are unspecified: on the CPU its buffer is allocated and nothing is
    /// written (the pages no one writes are never touched), elsewhere zeros. For room that is
    /// written before it is read.
    pub fn uninit(shape: &[usize], dtype: Dtype) -> Result<Array> {
        wrap(ffi::uninit(&to_i32_dims(shape)?, dtype as u8))
    }
    pub fn arange(start: f64, stop: f64, step: f64, dtype: Dtype) -> Result<Array> {
        wrap(ffi::arange(start, stop, step, dtype as u8))
    }

    pub fn shape(&self) -> Vec<usize> {
        ffi::shape(&self.0).into_iter().map(|d| d as usize).collect()
    }
    pub fn ndim(&self) -> usize {
        ffi::shape(&self.0).len()
    }
    /// Size of `axis` (negative counts from the end).
    pub fn dim(&self, axis: i32) -> usize {
        let shape = self.shape();
        let idx = if axis < 0 { shape.len() as i32 + axis } else { axis };
        shape[idx as usize]
    }
    pub fn dtype(&self) -> Dtype {
        Dtype::from_code(ffi::dtype(&self.0))
    }
    pub fn size(&self) -> usize {
        ffi::size(&self.0)
    }
    pub fn nbytes(&self) -> usize {
        ffi::nbytes(&self.0)
    }

    /// Evaluates and copies out as f32 (converting from any dtype).
    pub fn to_vec_f32(&self) -> Result<Vec<f32>> {
        Ok(ffi::to_f32(&self.0)?)
    }
    /// Evaluates and copies out as i32.
    pub fn to_vec_i32(&self) -> Result<Vec<i32>> {
        Ok(ffi::to_i32(&self.0)?)
    }
    /// Evaluates and copies out as u32.
    pub fn to_vec_u32(&self) -> Result<Vec<u32>> {
        Ok(ffi::to_u32(&self.0)?)
    }
    /// Whether the array's value is computed and can be read without waiting (a constant,
    /// or the output of finished work).
    pub fn is_available(&self) -> bool {
        ffi::is_available(&self.0)
    }
    /// The single element of a one-element array, as i32.
    pub fn item_i32(&self) -> Result<i32> {
        let v = self.to_vec_i32()?;
        match v.as_slice() {
            [x] => Ok(*x),
            _ => Err(Error::Invalid(format!("item() on an array of {} elements", v.len()))),
        }
    }
    pub fn item_f32(&self) -> Result<f32> {
        let v = self.to_vec_f32()?;
        match v.as_slice() {
            [x] => Ok(*x),
            _ => Err(Error::Invalid(format!("item() on an array of {} elements", v.len()))),
        }
    }
    /// Forces evaluation of this array.
    pub fn eval(&self) -> Result<()> {
        crate::eval(&[self])
    }

    pub fn astype(&self, dtype: Dtype) -> Result<Array> {
        wrap(ffi::astype(&self.0, dtype as u8))
    }
    pub fn reshape(&self, shape: &[i32]) -> Result<Array> {
        wrap(ffi::reshape(&self.0, shape))
    }
    pub fn transpose(&self, axes: &[i32]) -> Result<Array> {
        wrap(ffi::transpose(&self.0, axes))
    }
    pub fn expand_dims(&self, axes: &[i32]) -> Result<Array> {
        wrap(ffi::expand_dims(&self.0, axes))
    }
    pub fn squeeze(&self, axes: &[i32]) -> Result<Array> {
        wrap(ffi::squeeze(&self.0, axes))
    }
    pub fn broadcast_to(&self, shape: &[i32]) -> Result<Array> {
        wrap(ffi::broadcast_to(&self.0, shape))
    }
    /// `a[start:stop:strides]` over every axis.
    pub fn slice(&self, start: &[i32], stop: &[i32], strides: &[i32]) -> Result<Array> {
        wrap(ffi::slice(&self.0, start, stop, strides))
    }
    /// `a[start:stop]` along one axis, all of every other axis.
    pub fn slice_axis(&self, axis: i32, start: i32, stop: i32) -> Result<Array> {
        let shape = ffi::shape(&self.0);
        let n = shape.len() as i32;
        let axis = if axis < 0 { n + axis } else { axis } as usize;
        let mut lo = vec![0; shape.len()];
        let mut hi = shape.to_vec();
        lo[axis] = start;
        hi[axis] = stop;
        wrap(ffi::slice(&self.0, &lo, &hi, &vec![1; shape.len()]))
    }
    /// A copy of `self` with `update` written at `[start:stop:strides]`.
    pub fn slice_update(&self, update: &Array, start: &[i32], stop: &[i32], strides: &[i32]) -> Result<Array> {
        wrap(ffi::slice_update(&self.0, &update.0, start, stop, strides))
    }
    pub fn take(&self, indices: &Array, axis: i32) -> Result<Array> {
        wrap(ffi::take(&self.0, &indices.0, axis))
    }
    pub fn take_along_axis(&self, indices: &Array, axis: i32) -> Result<Array> {
        wrap(ffi::take_along_axis(&self.0, &indices.0, axis))
    }
    pub fn put_along_axis(&self, indices: &Array, values: &Array, axis: i32) -> Result<Array> {
        wrap(ffi::put_along_axis(&self.0, &indices.0, &values.0, axis))
    }
    pub fn scatter_add_axis(&self, indices: &Array, values: &Array, axis: i32) -> Result<Array> {
        wrap(ffi::scatter_add_axis(&self.0, &indices.0, &values.0, axis))
    }
    pub fn contiguous(&self) -> Result<Array> {
        wrap(ffi::contiguous(&self.0))
    }

    /// A copy with its own buffer (a slice of a large array, kept without it).
    pub fn copy(&self) -> Result<Array> {
        wrap(ffi::copy(&self.0))
    }

    pub fn add(&self, o: &Array) -> Result<Array> {
        wrap(ffi::add(&self.0, &o.0))
    }
    pub fn subtract(&self, o: &Array) -> Result<Array> {
        wrap(ffi::subtract(&self.0, &o.0))
    }
    pub fn multiply(&self, o: &Array) -> Result<Array> {
        wrap(ffi::multiply(&self.0, &o.0))
    }
    pub fn divide(&self, o: &Array) -> Result<Array> {
        wrap(ffi::divide(&self.0, &o.0))
    }
    pub fn maximum(&self, o: &Array) -> Result<Array> {
        wrap(ffi::maximum(&self.0, &o.0))
    }
    pub fn minimum(&self, o: &Array) -> Result<Array> {
        wrap(ffi::minimum(&self.0, &o.0))
    }
    pub fn greater(&self, o: &Array) -> Result<Array> {
        wrap(ffi::greater(&self.0, &o.0))
    }
    pub fn greater_equal(&self, o: &Array) -> Result<Array> {
        wrap(ffi::greater_equal(&self.0, &o.0))
    }
    pub fn less(&self, o: &Array) -> Result<Array> {
        wrap(ffi::less(&self.0, &o.0))
    }
    pub fn equal(&self, o: &Array) -> Result<Array> {
        wrap(ffi::equal(&self.0, &o.0))
    }
    pub fn logical_and(&self, o: &Array) -> Result<Array> {
        wrap(ffi::logical_and(&self.0, &o.0))
    }
    pub fn logical_or(&self, o: &Array) -> Result<Array> {
        wrap(ffi::logical_or(&self.0, &o.0))
    }
    /// `self // o` (integer division rounding down, for integer arrays).
    pub fn floor_divide(&self, o: &Array) -> Result<Array> {
        wrap(ffi::floor_divide(&self.0, &o.0))
    }
    /// `self & o` (integer and boolean arrays).
    pub fn bitwise_and(&self, o: &Array) -> Result<Array> {
        wrap(ffi::bitwise_and(&self.0, &o.0))
    }
    pub fn power(&self, o: &Array) -> Result<Array> {
        wrap(ffi::power(&self.0, &o.0))
    }
    pub fn negative(&self) -> Result<Array> {
        wrap(ffi::negative(&self.0))
    }
    pub fn exp(&self) -> Result<Array> {
        wrap(ffi::exp(&self.0))
    }
    pub fn log(&self) -> Result<Array> {
        wrap(ffi::log(&self.0))
    }
    pub fn sqrt(&self) -> Result<Array> {
        wrap(ffi::sqrt(&self.0))
    }
    pub fn sigmoid(&self) -> Result<Array> {
        wrap(ffi::sigmoid(&self.0))
    }

    pub fn sum(&self, axes: &[i32], keepdims: bool) -> Result<Array> {
        wrap(ffi::sum(&self.0, axes, keepdims))
    }
    pub fn max(&self, axes: &[i32], keepdims: bool) -> Result<Array> {
        wrap(ffi::max(&self.0, axes, keepdims))
    }
    pub fn mean(&self, axes: &[i32], keepdims: bool) -> Result<Array> {
        wrap(ffi::mean(&self.0, axes, keepdims))
    }
    pub fn logsumexp(&self, axes: &[i32], keepdims: bool) -> Result<Array> {
        wrap(ffi::logsumexp(&self.0, axes, keepdims))
    }
    pub fn argmax(&self, axis: i32, keepdims: bool) -> Result<Array> {
        wrap(ffi::argmax(&self.0, axis, keepdims))
    }
    pub fn cumsum(&self, axis: i32, reverse: bool, inclusive: bool) -> Result<Array> {
        wrap(ffi::cumsum(&self.0, axis, reverse, inclusive))
    }
    pub fn softmax(&self, axes: &[i32], precise: bool) -> Result<Array> {
        wrap(ffi::softmax(&self.0, axes, precise))
    }
    pub fn sort(&self, axis: i32) -> Result<Array> {
        wrap(ffi::sort(&self.0, axis))
    }
    pub fn argsort(&self, axis: i32) -> Result<Array> {
        wrap(ffi::argsort(&self.0, axis))
    }
    pub fn argpartition(&self, kth: i32, axis: i32) -> Result<Array> {
        wrap(ffi::argpartition(&self.0, kth, axis))
    }
}
